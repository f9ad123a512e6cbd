//! Which form of each dispatch a delegate runs: its portable kernel or one
//! of the payload's alternatives (tensor-core kernels, several variants of
//! them) that the device can run.
//!
//! With alternatives allowed (`--coop auto`), the choice is measured, not
//! assumed: the first time a payload loads on an adapter, every dispatch
//! that has alternatives is timed on the device in each form the device
//! can run (timestamp queries where it has them, else the wall time of a
//! submit and its wait), on the delegate's own buffers at the payload's
//! sizes, and the fastest is kept; an alternative must beat the portable
//! kernel by [`MARGIN`], so an alternative never makes a program slower on
//! a GPU nobody tested (Apple's included). Dispatches of one shape (the
//! same kernels and grids: a model's layers) are measured once. The
//! choices are kept on disk ([`TuningCache`]): later loads of the same
//! payload on the same adapter and driver measure nothing. A missing,
//! stale or unreadable cache entry is measured again; a cache that cannot
//! be written only costs the next load the measurement.
//!
//! `ETMETAL_COOP_FORCE=N` forces alternative `N` of every dispatch that
//! has it (where the device can run it), for tests and for timing each
//! variant; `ETMETAL_TUNING_CACHE=off` measures every load.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use etmetal_core::{Error, Result};
use etmetal_metal::payload::{Dispatch, Needs, Payload};

use crate::device::CoopOffer;

/// How much faster than the portable kernel an alternative must measure.
const MARGIN: f64 = 0.97;
/// Timed runs of each form (after one warm-up run).
const RUNS: usize = 5;

/// How a delegate chooses each dispatch's form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Selection {
    /// Every dispatch runs its portable kernel.
    Portable,
    /// The fastest form, measured (and cached), among the forms that have
    /// run on a real GPU ([`Needs::has_run`]), or all where `untested`.
    Measured { untested: bool },
    /// Alternative `N` wherever a dispatch has it and the device runs it.
    Forced(usize),
}

impl Selection {
    /// The backend's setting: portable unless `alternatives`
    /// (`with_cooperative_matrix`); then alternative `forced`
    /// (`with_forced_alternative`) or the one `ETMETAL_COOP_FORCE` names,
    /// else measured (`untested`: `with_untested_forms`).
    pub(crate) fn of(
        alternatives: bool,
        untested: bool,
        forced: Option<usize>,
    ) -> Result<Selection> {
        if !alternatives {
            return Ok(Selection::Portable);
        }
        if let Some(n) = forced {
            return Ok(Selection::Forced(n));
        }
        match std::env::var("ETMETAL_COOP_FORCE") {
            Ok(v) if !v.is_empty() => v.trim().parse().map(Selection::Forced).map_err(|_| {
                Error::invalid_input(format!(
                    "ETMETAL_COOP_FORCE={v}: expected an alternative's index (0, 1, …)"
                ))
            }),
            _ => Ok(Selection::Measured { untested }),
        }
    }
}

/// Per payload dispatch, the indices of the alternatives `offer` runs
/// whose kernels bind at most `max_bindings` buffers, and (unless
/// `untested`) whose form has run on a real GPU.
pub(crate) fn eligible(
    payload: &Payload,
    offer: Option<&CoopOffer>,
    max_bindings: u32,
    untested: bool,
) -> Vec<Vec<usize>> {
    payload
        .dispatches
        .iter()
        .map(|d| {
            d.alternatives
                .iter()
                .enumerate()
                .filter(|(_, a)| {
                    offer.is_some_and(|o| o.meets(&a.needs))
                        && (untested || a.needs.has_run())
                        && a.dispatches
                            .iter()
                            .all(|x| x.buffers.len() as u64 <= u64::from(max_bindings))
                })
                .map(|(i, _)| i)
                .collect()
        })
        .collect()
}

/// The form of one dispatch: `None` its portable kernel, `Some(i)` its
/// alternative `i`.
pub(crate) type Choice = Option<usize>;

/// One dispatch as a delegate runs it: a payload dispatch, or one of the
/// dispatches of the alternative chosen for it (its index and needs).
pub(crate) struct Launch {
    pub dispatch: Dispatch,
    pub variant: Option<(usize, Needs)>,
}

/// The dispatches to run for `choices` (one per payload dispatch).
pub(crate) fn launches(payload: &Payload, choices: &[Choice]) -> Vec<Launch> {
    let mut launches = Vec::with_capacity(payload.dispatches.len());
    for (d, choice) in payload.dispatches.iter().zip(choices) {
        match choice.and_then(|a| Some((a, d.alternatives.get(a)?))) {
            Some((i, a)) => launches.extend(a.dispatches.iter().map(|x| Launch {
                dispatch: x.clone(),
                variant: Some((i, a.needs)),
            })),
            None => launches.push(Launch {
                dispatch: Dispatch {
                    alternatives: vec![],
                    ..d.clone()
                },
                variant: None,
            }),
        }
    }
    launches
}

/// The fastest of `times` (the portable kernel's first, then each of
/// `alternatives`'), an alternative only where it beats the portable
/// kernel by [`MARGIN`].
pub(crate) fn fastest(times: &[f64], alternatives: &[usize]) -> Choice {
    let portable = *times.first()?;
    let (best, t) = times[1..]
        .iter()
        .zip(alternatives)
        .min_by(|a, b| a.0.total_cmp(b.0))?;
    (*best < portable * MARGIN && best.is_finite())
        .then_some(*t)
        .filter(|_| *best >= 0.0)
}

/// FNV-1a, 64 bits: a stable hash (std's hasher may change between
/// releases, and the cache outlives the binary).
pub(crate) fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // (parts apart: ["ab", "c"] and ["a", "bc"] differ)
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// What decides a dispatch's timings: its kernels and grids in each
/// candidate form (dispatches alike in these are measured once).
pub(crate) fn signature(payload: &Payload, d: &Dispatch, alternatives: &[usize]) -> String {
    let one = |x: &Dispatch| {
        let k = &payload.kernels[x.kernel];
        format!(
            "{:016x} {:?} {}|",
            fnv64(&[k.wgsl.as_bytes()]),
            x.workgroups,
            x.groups.is_some()
        )
    };
    let mut text = one(d);
    for &a in alternatives {
        text.push_str(&format!("alt {a}|"));
        d.alternatives[a]
            .dispatches
            .iter()
            .for_each(|x| text.push_str(&one(x)));
    }
    format!("{:016x}", fnv64(&[text.as_bytes()]))
}

/// The measured choices of one payload on one adapter, on disk under the
/// user's cache directory (`ETMETAL_CACHE_DIR`, else `$XDG_CACHE_HOME`,
/// else `~/.cache`, `~/Library/Caches` on macOS; `etmetal/tuning/`), one
/// JSON file per adapter, driver and payload. Written whole to a temporary
/// file then renamed, so concurrent processes never read half a file.
pub(crate) struct TuningCache {
    path: Option<PathBuf>,
    /// Signature -> (choice, milliseconds of each form measured).
    entries: BTreeMap<String, (Choice, Vec<f64>)>,
    changed: bool,
}

impl TuningCache {
    /// The cache of `payload` (its bytes) on the adapter `info` describes;
    /// empty when there is none, it does not parse, or caching is off.
    pub(crate) fn open(info: &wgpu::AdapterInfo, payload_hash: u64) -> TuningCache {
        let path = Self::dir().map(|dir| {
            let adapter = format!(
                "{}|{:?}|{}|{}|{}|{}",
                info.name, info.backend, info.vendor, info.device, info.driver, info.driver_info
            );
            dir.join(format!(
                "{:016x}-{payload_hash:016x}.json",
                fnv64(&[adapter.as_bytes()])
            ))
        });
        Self::at(path)
    }

    /// The cache in file `path` (none: nothing kept).
    fn at(path: Option<PathBuf>) -> TuningCache {
        let entries = path
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
            .map(|v| Self::parse(&v))
            .unwrap_or_default();
        TuningCache {
            path,
            entries,
            changed: false,
        }
    }

    fn dir() -> Option<PathBuf> {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        if std::env::var("ETMETAL_TUNING_CACHE").is_ok_and(|v| v == "off") {
            return None;
        }
        let base = var("ETMETAL_CACHE_DIR").or_else(|| {
            let home = var("HOME");
            if cfg!(target_os = "macos") {
                home.map(|h| h.join("Library/Caches/etmetal"))
            } else {
                var("XDG_CACHE_HOME")
                    .or_else(|| home.map(|h| h.join(".cache")))
                    .map(|c| c.join("etmetal"))
            }
        })?;
        Some(base.join("tuning"))
    }

    /// The entries of a cache file's JSON (those that do not parse are
    /// dropped: measured again).
    fn parse(v: &serde_json::Value) -> BTreeMap<String, (Choice, Vec<f64>)> {
        let Some(map) = v.get("choices").and_then(|c| c.as_object()) else {
            return BTreeMap::new();
        };
        map.iter()
            .filter_map(|(sig, e)| {
                let choice = match e.get("pick")? {
                    serde_json::Value::Null => None,
                    p => Some(usize::try_from(p.as_u64()?).ok()?),
                };
                let ms = e
                    .get("ms")?
                    .as_array()?
                    .iter()
                    // (a form left out is infinitely slow: JSON's null)
                    .map(|x| match x {
                        serde_json::Value::Null => Some(f64::INFINITY),
                        x => x.as_f64(),
                    })
                    .collect::<Option<Vec<f64>>>()?;
                Some((sig.clone(), (choice, ms)))
            })
            .collect()
    }

    /// The cached choice for `signature` among `alternatives`, if any (one
    /// naming an alternative not among them is stale).
    pub(crate) fn get(&self, signature: &str, alternatives: &[usize]) -> Option<Choice> {
        let (choice, _) = self.entries.get(signature)?;
        match choice {
            Some(a) if !alternatives.contains(a) => None,
            c => Some(*c),
        }
    }

    pub(crate) fn put(&mut self, signature: String, choice: Choice, ms: Vec<f64>) {
        self.entries.insert(signature, (choice, ms));
        self.changed = true;
    }

    /// Write the cache if it changed; failures are not errors (the next
    /// load measures again).
    pub(crate) fn save(&self) {
        let Some(path) = &self.path else { return };
        if !self.changed {
            return;
        }
        let choices: serde_json::Map<String, serde_json::Value> = self
            .entries
            .iter()
            .map(|(sig, (choice, ms))| {
                (sig.clone(), serde_json::json!({ "pick": choice, "ms": ms }))
            })
            .collect();
        let text = serde_json::json!({ "version": 1, "choices": choices }).to_string();
        let Some(dir) = path.parent() else { return };
        let tmp = dir.join(format!(
            ".{}.{}.{:?}.tmp",
            path.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            std::process::id(),
            std::thread::current().id()
        ));
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&tmp, text))
            .and_then(|()| std::fs::rename(&tmp, path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// One form of a dispatch as the device runs it: each of its dispatches'
/// pipeline, bind group and workgroup counts.
pub(crate) type Form<'a> = Vec<(&'a wgpu::ComputePipeline, &'a wgpu::BindGroup, [u32; 3])>;

/// The median GPU milliseconds of each of `forms` over [`RUNS`] runs
/// after a warm-up, the forms interleaved run by run: from timestamps
/// written at the start and end of each form's compute pass where the
/// device has timestamp queries, else the wall time of a submit and its
/// wait.
pub(crate) fn time_forms(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    forms: &[Form],
    timeout: Duration,
) -> Result<Vec<f64>> {
    let stamps = device.features().contains(wgpu::Features::TIMESTAMP_QUERY);
    let mut times: Vec<Vec<f64>> = vec![vec![]; forms.len()];
    let wait = |index| {
        device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: Some(timeout),
            })
            .map_err(|e| Error::internal(format!("waiting for the GPU while timing kernels: {e}")))
    };
    let record = |encoder: &mut wgpu::CommandEncoder,
                  form: &Form,
                  writes: Option<wgpu::ComputePassTimestampWrites>| {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("etmetal kernel timing"),
            timestamp_writes: writes,
        });
        for (pipeline, group, [x, y, z]) in form {
            if *x > 0 {
                pass.set_pipeline(pipeline);
                pass.set_bind_group(0, *group, &[]);
                pass.dispatch_workgroups(*x, *y, *z);
            }
        }
    };
    if !stamps {
        for run in 0..=RUNS {
            for (f, form) in forms.iter().enumerate() {
                let mut encoder = device.create_command_encoder(&Default::default());
                record(&mut encoder, form, None);
                let start = Instant::now();
                wait(queue.submit([encoder.finish()]))?;
                if run > 0 {
                    times[f].push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        return Ok(times.iter_mut().map(|t| median(t)).collect());
    }
    let count = 2 * forms.len() * (RUNS + 1);
    if count > wgpu::QUERY_SET_MAX_QUERIES as usize {
        return Err(Error::internal(format!(
            "timing {} forms takes {count} timestamps",
            forms.len()
        )));
    }
    let set = device.create_query_set(&wgpu::QuerySetDescriptor {
        label: Some("etmetal kernel timing"),
        ty: wgpu::QueryType::Timestamp,
        count: count as u32,
    });
    let bytes = (count as u64) * u64::from(wgpu::QUERY_SIZE);
    let buffer = |usage| {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("etmetal kernel timing"),
            size: bytes,
            usage,
            mapped_at_creation: false,
        })
    };
    let resolve = buffer(wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC);
    let readback = buffer(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST);
    let mut encoder = device.create_command_encoder(&Default::default());
    let mut q = 0;
    for _ in 0..=RUNS {
        for form in forms {
            let writes = wgpu::ComputePassTimestampWrites {
                query_set: &set,
                beginning_of_pass_write_index: Some(q),
                end_of_pass_write_index: Some(q + 1),
            };
            record(&mut encoder, form, Some(writes));
            q += 2;
        }
    }
    encoder.resolve_query_set(&set, 0..q, &resolve, 0);
    encoder.copy_buffer_to_buffer(&resolve, 0, &readback, 0, bytes);
    let index = queue.submit([encoder.finish()]);
    let (tx, rx) = std::sync::mpsc::channel();
    readback.map_async(wgpu::MapMode::Read, .., move |r| drop(tx.send(r)));
    wait(index)?;
    rx.recv_timeout(timeout)
        .map_err(|_| Error::internal("the kernel timings were not mapped"))?
        .map_err(|e| Error::internal(format!("reading the kernel timings: {e}")))?;
    let period = f64::from(queue.get_timestamp_period()) * 1e-6;
    {
        let view = readback
            .get_mapped_range(..)
            .map_err(|e| Error::internal(format!("reading the kernel timings: {e}")))?;
        let ticks: Vec<u64> = view
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        for (i, pair) in ticks.chunks_exact(2).enumerate() {
            let (run, f) = (i / forms.len(), i % forms.len());
            if run > 0 {
                times[f].push(pair[1].saturating_sub(pair[0]) as f64 * period);
            }
        }
    }
    readback.unmap();
    Ok(times.iter_mut().map(|t| median(t)).collect())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::INFINITY)
}

/// Each dispatch's choice: cached, or measured by `measure` (called once
/// per signature not cached, with the dispatch and its alternatives; it
/// returns the milliseconds of the portable form, then of each
/// alternative).
pub(crate) fn measured(
    payload: &Payload,
    eligible: &[Vec<usize>],
    cache: &mut TuningCache,
    mut measure: impl FnMut(usize, &[usize]) -> Result<Vec<f64>>,
) -> Result<Vec<Choice>> {
    let mut seen: HashMap<String, Choice> = HashMap::new();
    let mut choices = Vec::with_capacity(payload.dispatches.len());
    for (d, (dispatch, alts)) in payload.dispatches.iter().zip(eligible).enumerate() {
        if alts.is_empty() {
            choices.push(None);
            continue;
        }
        let sig = signature(payload, dispatch, alts);
        let choice = match seen.get(&sig).copied().or_else(|| cache.get(&sig, alts)) {
            Some(c) => c,
            None => {
                let ms = measure(d, alts)?;
                let c = fastest(&ms, alts);
                cache.put(sig.clone(), c, ms);
                c
            }
        };
        seen.insert(sig, choice);
        choices.push(choice);
    }
    Ok(choices)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fastest form wins, an alternative only by the margin; no
    /// timings or broken ones keep the portable kernel.
    #[test]
    fn an_alternative_must_beat_the_portable_kernel() {
        assert_eq!(fastest(&[1.0, 0.5, 0.4], &[0, 2]), Some(2));
        assert_eq!(fastest(&[1.0, 0.99], &[0]), None, "within the margin");
        assert_eq!(fastest(&[1.0, 2.0, 0.9], &[1, 3]), Some(3));
        assert_eq!(fastest(&[1.0, f64::NAN], &[0]), None);
        assert_eq!(fastest(&[1.0, f64::INFINITY], &[0]), None);
        assert_eq!(fastest(&[], &[]), None);
    }

    fn payload(dispatches: Vec<Dispatch>, kernels: usize) -> Payload {
        let kernel = |i: usize| etmetal_metal::payload::Kernel {
            name: format!("k{i}"),
            ops: vec![],
            wgsl: format!("// kernel {i}"),
            msl: String::new(),
            entry_point: "main".into(),
            bindings: vec![],
            workgroup_size: [1, 1, 1],
            sizes: false,
        };
        Payload {
            buffers: vec![],
            kernels: (0..kernels).map(kernel).collect(),
            dispatches,
            inputs: vec![],
            outputs: vec![],
            arenas: vec![],
            requirements: Default::default(),
            state: vec![],
            checks: vec![],
            symbols: vec![],
        }
    }

    fn dispatch(kernel: usize, alternatives: &[usize]) -> Dispatch {
        let plain = |kernel| Dispatch {
            kernel,
            nodes: vec![],
            buffers: vec![],
            workgroups: [4, 1, 1],
            groups: None,
            alternatives: vec![],
        };
        Dispatch {
            alternatives: alternatives
                .iter()
                .map(|&k| etmetal_metal::payload::Alternative {
                    needs: Needs::f16_16x16x16(32, 0),
                    dispatches: vec![plain(k)],
                })
                .collect(),
            ..plain(kernel)
        }
    }

    /// Dispatches alike (a model's layers) are measured once; a second
    /// load finds every choice in the cache file and measures nothing; a
    /// cached choice naming an alternative the device cannot run (another
    /// offer) is stale and measured again; a cache file that does not
    /// parse is measured over.
    #[test]
    fn choices_are_measured_once_and_cached() {
        let p = payload(
            vec![
                dispatch(0, &[1, 2]),
                dispatch(0, &[1, 2]),
                dispatch(3, &[]),
                dispatch(4, &[1]),
            ],
            5,
        );
        let both = vec![vec![0, 1], vec![0, 1], vec![], vec![0]];
        let dir = std::env::temp_dir().join(format!("etmetal-tuning-{}", std::process::id()));
        let file = dir.join("cache.json");
        let _ = std::fs::remove_dir_all(&dir);
        // portable 1 ms; alternative 1 of the first shape is faster, the
        // last dispatch's alternative slower
        let timings = |d: usize, alts: &[usize]| -> Vec<f64> {
            let mut ms = vec![1.0];
            ms.extend(
                alts.iter()
                    .map(|&a| if d == 3 { 2.0 } else { 0.5 - a as f64 * 0.1 }),
            );
            ms
        };
        let mut calls = vec![];
        let mut cache = TuningCache::at(Some(file.clone()));
        let choices = measured(&p, &both, &mut cache, |d, alts| {
            calls.push(d);
            Ok(timings(d, alts))
        })
        .unwrap();
        assert_eq!(choices, [Some(1), Some(1), None, None]);
        assert_eq!(calls, [0, 3], "each shape once");
        cache.save();
        let mut again = TuningCache::at(Some(file.clone()));
        let choices = measured(&p, &both, &mut again, |d, _| panic!("measured {d} again")).unwrap();
        assert_eq!(choices, [Some(1), Some(1), None, None]);
        // another device runs only alternative 0: the cached 1 is stale
        let fewer = vec![vec![0], vec![0], vec![], vec![0]];
        let mut calls = vec![];
        let choices = measured(&p, &fewer, &mut again, |d, alts| {
            calls.push(d);
            Ok(timings(d, alts))
        })
        .unwrap();
        assert_eq!(choices, [Some(0), Some(0), None, None]);
        assert_eq!(calls, [0], "(the last shape's portable choice still holds)");
        std::fs::write(&file, b"{ not json").unwrap();
        let mut broken = TuningCache::at(Some(file));
        let mut calls = 0;
        measured(&p, &both, &mut broken, |d, alts| {
            calls += 1;
            Ok(timings(d, alts))
        })
        .unwrap();
        assert_eq!(calls, 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A form the driver would not build is timed as infinitely slow: it
    /// is never chosen, and the cache keeps that (JSON's null) so that a
    /// later load neither builds it again nor trusts it.
    #[test]
    fn a_form_left_out_is_never_chosen_and_stays_cached() {
        let p = payload(vec![dispatch(0, &[1, 2]), dispatch(3, &[4])], 5);
        let eligible = vec![vec![0, 1], vec![0]];
        let dir = std::env::temp_dir().join(format!("etmetal-left-out-{}", std::process::id()));
        let file = dir.join("cache.json");
        let _ = std::fs::remove_dir_all(&dir);
        let mut cache = TuningCache::at(Some(file.clone()));
        let choices = measured(&p, &eligible, &mut cache, |d, _| {
            Ok(match d {
                0 => vec![1.0, f64::INFINITY, 0.5],
                _ => vec![1.0, f64::INFINITY],
            })
        })
        .unwrap();
        assert_eq!(choices, [Some(1), None]);
        cache.save();
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("null"), "{text}");
        let mut again = TuningCache::at(Some(file));
        let choices = measured(&p, &eligible, &mut again, |d, _| {
            panic!("measured {d} again")
        })
        .unwrap();
        assert_eq!(choices, [Some(1), None]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_hash_is_stable_and_separates_parts() {
        assert_eq!(fnv64(&[b""]), fnv64(&[b""]));
        assert_ne!(fnv64(&[b"ab", b"c"]), fnv64(&[b"a", b"bc"]));
        // (a fixed value: the cache's file names must not change between builds)
        assert_eq!(fnv64(&[b"etmetal"]), 0xa263_d208_01a7_d9c0);
    }
}
