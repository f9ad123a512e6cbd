//! `--quantize int4|int8|mixed`: every linear whose weight is a constant
//! and whose K divides by the group size becomes a weight-only quantized
//! linear ([`Op::Int4Linear`], [`Op::Int8Linear`]) reading codes in the
//! layout of [`etmetal_core::quant`] (as int32 words), one scale and one
//! zero per group of each output channel, stored in the weight's dtype.
//!
//! Which linears: `Op::Linear` (`x @ W.T + b`) and `Op::MatMul` of an
//! activation of rank >= 2 with a constant 2-D `B = W.T`. A weight is left
//! alone when K does not divide by the group, when the constant holds no
//! data, or when its name (parameter fqn, or value name) or the node's name
//! contains one of the skip patterns.
//!
//! The schemes ([`Scheme`]):
//! - `int4`: 4-bit codes in groups of 32 (`--group-size` 32..256);
//! - `int8`: 8-bit codes, one scale and zero per output channel (a group
//!   of all of K), or per group with `--group-size` (a multiple of 32);
//! - `mixed`: int8 (per channel) for the weights whose int4 form would
//!   change the linear's output most, int4 for the rest ([`mixed`] has the
//!   rule and what it measures).
//!
//! How each weight is rounded: without calibration, each group is fitted
//! to its own values ([`fit`]: min-max, least-squares refinement, the
//! codes re-rounded to the stored scale and zero). With calibration
//! statistics for the weight ([`Calibration`]: the second moments of the
//! activations the linear reads, over the user's text, gathered by
//! `etmetal::calibrate`), the columns are rounded one at a time with
//! GPTQ's error feedback ([`gptq`]), which minimises the error of the
//! product with those activations rather than of the weight.
//!
//! A mixture-of-experts layer's stacked expert weights, read by its
//! grouped matmul (a decode step's few routed rows, or a prefill's every
//! expert's product), become int4 `[E, N, K]` and the product
//! [`Op::GatherQmv`] ([`experts`]: the same fitting per expert as a
//! linear's; int4 only, since the kernel has no int8 form: under int8 the
//! experts stay in float, under mixed they are int4 and not measured; no
//! calibration), where every reader of the weights in every method is
//! such a product (`--quantize-skip experts` keeps them in float).
//!
//! Linears of one input (q, k and v; gate and up) with weights of one
//! format then become one product of their weights concatenated along N,
//! each output a slice of it: `crate::siblings`, which the compile runs
//! after quantization for every dtype.
//!
//! The LM head is quantized by default, as the seed's `fpa4w` filter does
//! (every `nn.Linear`): it is the largest matmul of a decoder step, so it
//! gains most from narrow reads. An embedding is a gather, not a linear: its
//! table is quantized only where it is also a quantized linear's weight (a
//! head tied to the embedding, Gemma's): then the gather reads the rows of
//! the head's quantized table and dequantizes them (`quantized_gather`:
//! existing ops, fused on the GPU), and the float table is gone from the
//! file. An untied embedding stays in float: a decode step reads one row of
//! it, so narrow codes would save disk but no time. `--quantize-skip
//! lm_head` keeps a head in float, and for a tied head, whose weight
//! carries the embedding's name, the embedding's name does
//! (`--quantize-skip embed_tokens`; the table then stays in float too).
//!
//! What the schemes cost Gemma 3 270M (real weights, teacher-forced through
//! `etmetal compile`, scripts/eval_llm.py; BENCHMARKS.md has the table):
//! see the figures below the history of int4's rounding.
//!
//! Plain int4 on Gemma 3 270M (scripts/int4_sensitivity.py: every linear
//! of eager transformers replaced by its dequantized weight, against the
//! bf16 weights, 600 tokens of tests/parity/data/around_the_world_ch1.txt;
//! next-token agreement, mean KL, perplexity (bf16: 23.92), weight error):
//!   min-max + refinement:             77.3%, 0.177, 28.76, 6.13e-3
//!   the same, codes re-rounded (3.):  78.3%, 0.179, 28.67, 6.12e-3
//! and on 300 tokens: min-max alone 70.3%, 0.248, 31.42, 7.21e-3; group
//! 64 67.7%, 0.318, 33.12, 9.48e-3 (group 32: 77.3%, 0.166, 28.71). Through
//! `etmetal compile` (scripts/eval_llm.py, 1165 tokens; perplexity of bf16
//! 30.55): before step 3 75.7%, 0.201, 37.57; with it 75.4%, 0.204, 37.71,
//! the same within the noise: step 3 is kept because it makes each code
//! the nearest on the grid the kernels read, for no cost.
//! Tried and left out:
//! - a clip search before the refinement, as llama.cpp's
//!   `make_qkx2_quants` (codes rounded with the step `(max - min) / r`,
//!   r over 14..16 and 10..13, least-squares refit, the group's best kept):
//!   weight error -8% (gaussian 4.80e-3, student-t 6.45e-3, Gemma 5.62e-3),
//!   but through `etmetal compile` on 1165 tokens (scripts/eval_llm.py)
//!   agreement 73.6% against refinement's 75.4%, KL 0.186 against
//!   0.204, perplexity 38.25 against 37.71, for 4x the quantization time;
//! - weighing each input channel's error by the square of the RMSNorm
//!   scale in front of the linear (data-free): worse (74.8%, 0.219).
//!
//! So about 75% agreement is what per-group 4-bit rounding gives this
//! model without calibration. Sensitivity per tensor kind (300 tokens, one
//! kind in int4 at a time): v_proj 91.0%, up_proj 91.0%, gate_proj 91.7%,
//! down_proj 91.7%, q_proj 94.7%, k_proj 95.7%, o_proj 97.7% (Q4_K in the
//! GGUF: already on a 4-bit grid); the first or the last layer alone 95%;
//! the head alone 84.7%.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use etmetal_core::quant::{as_words, QuantFormat};
use etmetal_core::{BinaryOp, DType, Error, Op, Result, Tensor};
use rayon::prelude::*;

use crate::decompose::eliminate_dead_code;
use crate::ir::{Graph, InputKind, Node, ValueId};
use crate::rewrite::Rewrite;

pub mod experts;
pub mod fit;
pub mod gptq;
pub mod mixed;

pub use fit::{dequantize_weight, quantize_weight, Fit, QuantWeight};
use fit::{quantize_tensors, Values};
pub use gptq::{gptq, InputStats};
pub use mixed::Sensitivity;

/// int4's default group size.
pub const INT4_GROUP: usize = 32;

/// Which code widths the linears get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    Int4,
    Int8,
    /// int8 for the most sensitive weights, int4 for the rest.
    Mixed,
}

impl Scheme {
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Int4 => "int4",
            Scheme::Int8 => "int8",
            Scheme::Mixed => "mixed",
        }
    }
}

/// What `--quantize` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizeOptions {
    pub scheme: Scheme,
    /// The groups of int4 weights (int4 and mixed; default
    /// [`INT4_GROUP`]), or of int8 weights (int8; default one group of all
    /// of K, per output channel).
    pub group_size: Option<usize>,
    /// Linears whose weight or node name contains one of these stay in
    /// float.
    pub skip: Vec<String>,
}

impl QuantizeOptions {
    pub fn int4(group_size: usize, skip: &[String]) -> QuantizeOptions {
        QuantizeOptions {
            scheme: Scheme::Int4,
            group_size: Some(group_size),
            skip: skip.to_vec(),
        }
    }

    /// Error unless the group size suits the scheme (checked before any
    /// work, with the flag's name).
    pub fn check(&self) -> Result<()> {
        let Some(g) = self.group_size else {
            return Ok(());
        };
        let format = match self.scheme {
            Scheme::Int8 => QuantFormat::int8(g),
            _ => QuantFormat::int4(g),
        };
        // K = g: only the group's own rule
        format
            .check_group(g)
            .map_err(|e| Error::invalid_input(format!("--group-size {g}: {}", e.message())))
    }

    /// The format of a weight with `k` input channels: `int8` where the
    /// plan says so (mixed), else the scheme's.
    fn format(&self, k: usize, int8: bool) -> QuantFormat {
        match (self.scheme, int8) {
            (Scheme::Int8, _) => QuantFormat::int8(self.group_size.unwrap_or(k)),
            (_, true) => QuantFormat::int8(k),
            _ => QuantFormat::int4(self.group_size.unwrap_or(INT4_GROUP)),
        }
    }
}

/// Calibration statistics: for each weight (by name, as [`weight_name`]
/// gives it), the second moments of the activations its linear read over
/// the calibration tokens. Linears of one input share one [`InputStats`].
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    pub stats: HashMap<String, Arc<InputStats>>,
    /// Tokens run.
    pub tokens: usize,
}

/// How [`Quantizer::plan`] measures a weight's int4 form: given the
/// weight's name and its dequantized int4 values `[N, K]` (`N`, `K`), the
/// cost of that form (larger: more sensitive), or `None` where the
/// measurement cannot see the weight. `etmetal::calibrate::Sweep` runs the
/// model with the weight alone replaced and gives the mean KL divergence of
/// its logits.
pub type Measure<'a> = dyn FnMut(&str, &[f32], usize, usize) -> Result<Option<f64>> + 'a;

/// What [`Quantizer::quantize`] did to one graph.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantizeReport {
    /// Nodes whose weight was quantized, and its format.
    pub quantized: Vec<(String, QuantFormat)>,
    /// `(node, why)` for linears left in float.
    pub skipped: Vec<(String, String)>,
    /// Quantized nodes whose weight came from the cache (made for another
    /// method or node), a subset of `quantized`.
    pub reused: Vec<String>,
    /// Embedding nodes that now gather rows of a quantized table.
    pub embeddings: Vec<String>,
    /// Quantized with calibration (GPTQ), a subset of `quantized`.
    pub calibrated: Vec<String>,
    /// Products of routed rows by stacked expert weights now
    /// `gather_qmv` of int4 weights ([`experts`]): `(node, weight)`.
    pub experts: Vec<(String, String)>,
    /// `(node, weight, why)` for such products left in float.
    pub experts_skipped: Vec<(String, String, String)>,
}

impl QuantizeReport {
    /// The quantized nodes' names.
    pub fn nodes(&self) -> Vec<&str> {
        self.quantized.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// How many stacked expert weights are in int4, and how many stay in
    /// float (each counted once, however many products read it).
    pub fn expert_weights(&self) -> (usize, usize) {
        let int4: HashSet<&str> = self.experts.iter().map(|(_, w)| w.as_str()).collect();
        let float: HashSet<&str> = (self.experts_skipped.iter())
            .map(|(_, w, _)| w.as_str())
            .collect();
        (int4.len(), float.len())
    }

    /// How many weights of each format, `int4 (group 32): 12, int8 …`.
    pub fn summary(&self) -> String {
        let mut counts: Vec<(QuantFormat, usize)> = vec![];
        for (_, f) in &self.quantized {
            match counts.iter_mut().find(|(g, _)| g == f) {
                Some((_, c)) => *c += 1,
                None => counts.push((*f, 1)),
            }
        }
        counts.sort_by_key(|(f, _)| (f.bits, f.group_size));
        counts
            .iter()
            .map(|(f, c)| format!("{c} in {} (group {})", f.name(), f.group_size))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The name of weight `v` (its parameter's fqn, else its value name).
pub fn weight_name(g: &Graph, v: ValueId) -> String {
    g.inputs
        .iter()
        .find_map(|(id, kind)| match kind {
            InputKind::Parameter { fqn }
            | InputKind::Buffer { fqn, .. }
            | InputKind::Constant { fqn }
                if *id == v =>
            {
                Some(fqn.clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| g.value(v).name.clone())
}

/// A quantizable linear's weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearWeight {
    pub value: ValueId,
    /// Stored as `B = W.T` (a matmul's).
    pub transposed: bool,
    pub n: usize,
    pub k: usize,
}

/// A linear node's weight: `Op::Linear`'s, or a matmul's constant `B` of
/// an activation of rank >= 2; or why it is not quantized.
pub fn linear_weight(g: &Graph, node: &Node) -> std::result::Result<LinearWeight, String> {
    let (w, transposed) = match &node.op {
        Op::Linear => (node.inputs.get(1).copied().flatten(), false),
        Op::MatMul => (node.inputs.get(1).copied().flatten(), true),
        _ => return Err("not a linear".into()),
    };
    let w = w.ok_or("no weight")?;
    let t = g.constants.get(&w).ok_or("its weight is not a constant")?;
    if g.fake_constants.contains(&w) {
        return Err("its weight holds no data".into());
    }
    if !t.dtype().is_float() || t.rank() != 2 {
        return Err(format!(
            "weight {} {:?} is not a float matrix",
            t.dtype(),
            t.shape()
        ));
    }
    let x = node.inputs[0].map(|x| g.value(x)).ok_or("no input")?;
    if x.shape.len() < 2 && transposed {
        return Err("a matmul of a vector".into());
    }
    let (r, c) = (t.shape()[0], t.shape()[1]);
    let (n, k) = if transposed { (c, r) } else { (r, c) };
    Ok(LinearWeight {
        value: w,
        transposed,
        n,
        k,
    })
}

/// The weight `t` as `W [N, K]`, row-major f32.
pub fn weight_values(t: &Tensor, transposed: bool) -> Vec<f32> {
    let v = t.to_f32_vec();
    if !transposed {
        return v;
    }
    let (r, c) = (t.shape()[0], t.shape()[1]);
    let mut wt = vec![0.0f32; r * c];
    // a row of W a task
    wt.par_chunks_mut(r.max(1))
        .enumerate()
        .for_each(|(j, row)| {
            for (i, x) in row.iter_mut().enumerate() {
                *x = v[i * c + j];
            }
        });
    wt
}

/// A hash of `t`'s dtype, shape and bytes, the bytes hashed in parallel
/// pieces (a weight of a decoder is hundreds of MiB): the same whatever
/// the number of threads.
fn bytes_hash(t: &Tensor) -> u64 {
    let pieces: Vec<u64> = t
        .bytes()
        .par_chunks(1 << 20)
        .map(|piece| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            piece.hash(&mut h);
            h.finish()
        })
        .collect();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (t.dtype().name(), t.shape(), pieces).hash(&mut h);
    h.finish()
}

/// A weight as the cache keys it: its name, layout, format and a hash of
/// its bytes (a method of another model with a weight of the same name is
/// quantized anew).
type WeightKey = (String, bool, QuantFormat, u64);

/// A linear of a graph: its weight's name and the weight, or why it
/// stays in float.
struct Candidate {
    node: String,
    weight: std::result::Result<(String, LinearWeight), String>,
}

/// Quantizes the linears of every method of one program: the weights the
/// methods share are quantized once (the cache), and a mixed plan, made
/// once over all of them, gives a weight the same format in every method.
pub struct Quantizer<'c> {
    options: QuantizeOptions,
    calibration: Option<&'c Calibration>,
    done: HashMap<WeightKey, [Tensor; 3]>,
    /// Weights (by name) a mixed plan puts in int8.
    int8: HashSet<String>,
    /// What [`Quantizer::plan`] measured (mixed), most sensitive first.
    pub sensitivity: Vec<Sensitivity>,
    /// Stacked expert weights (by name) that some method reads other than
    /// by a routed product, and why: they stay in float in every method.
    float_experts: HashMap<String, String>,
}

impl<'c> Quantizer<'c> {
    pub fn new(options: QuantizeOptions, calibration: Option<&'c Calibration>) -> Quantizer<'c> {
        Quantizer {
            options,
            calibration,
            done: HashMap::new(),
            int8: HashSet::new(),
            sensitivity: vec![],
            float_experts: HashMap::new(),
        }
    }

    pub fn options(&self) -> &QuantizeOptions {
        &self.options
    }

    /// The linears of `graph`, in order (a matmul only where its `B` is
    /// a weight it could take).
    fn candidates(&self, graph: &Graph) -> Vec<Candidate> {
        let mut out = vec![];
        for node in &graph.nodes {
            let weight = match linear_weight(graph, node) {
                Ok(w) => w,
                Err(why) if matches!(node.op, Op::Linear) => {
                    out.push(Candidate {
                        node: node.name.clone(),
                        weight: Err(why),
                    });
                    continue;
                }
                Err(_) => continue,
            };
            let name = weight_name(graph, weight.value);
            let skip = self
                .options
                .skip
                .iter()
                .find(|p| name.contains(p.as_str()) || node.name.contains(p.as_str()))
                .map(|p| format!("matches --quantize-skip {p}"))
                .or_else(|| {
                    let f = self.options.format(weight.k, false);
                    f.check_group(weight.k)
                        .err()
                        .map(|e| e.message().to_string())
                });
            out.push(Candidate {
                node: node.name.clone(),
                weight: match skip {
                    Some(why) => Err(why),
                    None => Ok((name, weight)),
                },
            });
        }
        out
    }

    /// `mixed`: measure every quantizable weight of `graphs` (each once)
    /// and choose the ones that go to int8 ([`mixed::choose`]); their
    /// int4 forms made on the way are kept for the weights that stay int4.
    /// Each weight's int4 form is measured by `measure` where given (with
    /// calibration: what it does to the model's logits, [`Measure`]), else
    /// by [`mixed::output_error`]. Nothing to do for the other schemes.
    /// Every scheme: the stacked expert weights that a method reads other
    /// than by a routed product stay in float in all of them
    /// ([`experts::float_readers`]), so no weight is in the file twice.
    pub fn plan(&mut self, graphs: &[&Graph], mut measure: Option<&mut Measure<'_>>) -> Result<()> {
        self.float_experts = float_experts(graphs);
        if self.options.scheme != Scheme::Mixed {
            return Ok(());
        }
        let mut seen = HashSet::new();
        let mut measured = vec![];
        for graph in graphs {
            for c in self.candidates(graph) {
                let Ok((name, weight)) = c.weight else {
                    continue;
                };
                if !seen.insert((name.clone(), weight.transposed)) {
                    continue;
                }
                let t = &graph.constants[&weight.value];
                let w = weight_values(t, weight.transposed);
                let (n, k) = (weight.n, weight.k);
                let format = self.options.format(k, false);
                let (made, _) = self.made(&name, t, weight.transposed, format, Some(&w))?;
                let q = QuantWeight {
                    format,
                    packed: made[0].bytes().to_vec(),
                    scales: made[1].to_f32_vec(),
                    zeros: made[2].to_f32_vec(),
                };
                let error = match measure.as_deref_mut() {
                    Some(measure) => {
                        let deq = dequantize_weight(&q, k);
                        // a weight the measured method does not read
                        // ranks last
                        measure(&name, &deq, n, k)?.unwrap_or(0.0)
                    }
                    None => {
                        let stats = self
                            .calibration
                            .and_then(|cal| cal.stats.get(&name))
                            .map(|s| s.as_ref());
                        mixed::output_error(&w, n, k, &q, stats)
                    }
                };
                measured.push(Sensitivity {
                    weight: name.clone(),
                    elements: n * k,
                    error,
                    int8: false,
                });
            }
        }
        self.sensitivity = mixed::choose(measured);
        self.int8 = self
            .sensitivity
            .iter()
            .filter(|s| s.int8)
            .map(|s| s.weight.clone())
            .collect();
        Ok(())
    }

    /// The quantized constants of weight `name` (`w`, its values as
    /// `[N, K]` where the caller has them, else read from `t`) in
    /// `format`: from the cache, or made (with GPTQ where the calibration
    /// has the weight's statistics). Whether they came from the cache.
    fn made(
        &mut self,
        name: &str,
        t: &Tensor,
        transposed: bool,
        format: QuantFormat,
        w: Option<&[f32]>,
    ) -> Result<([Tensor; 3], bool)> {
        let key = (name.to_string(), transposed, format, bytes_hash(t));
        if let Some(made) = self.done.get(&key) {
            return Ok((made.clone(), true));
        }
        let (r, c) = (t.shape()[0], t.shape()[1]);
        let (n, k) = if transposed { (c, r) } else { (r, c) };
        let dtype = t.dtype();
        let owned;
        // the weight as it is stored where its rows are W's: converted a
        // part at a time as it is quantized
        let w = match w {
            Some(w) => Values::F32(w),
            None if !transposed && dtype.is_float() => Values::Tensor(t),
            None => {
                owned = weight_values(t, transposed);
                Values::F32(&owned)
            }
        };
        let stats = self.calibration.and_then(|cal| cal.stats.get(name));
        let made = match stats {
            Some(stats) => {
                let owned;
                let w = match w {
                    Values::F32(w) => w,
                    Values::Tensor(t) => {
                        owned = t.to_f32_vec();
                        &owned[..]
                    }
                };
                let q = gptq(w, n, k, stats, format, dtype)
                    .map_err(|e| e.context(format!("quantizing `{name}`")))?;
                let groups = k / format.group_size;
                [
                    as_words(&Tensor::from_slice(
                        DType::U8,
                        &[n, k / format.per_byte()],
                        &q.packed,
                    )?)?,
                    Tensor::from_f32(dtype, &[n, groups], &q.scales)?,
                    Tensor::from_f32(dtype, &[n, groups], &q.zeros)?,
                ]
            }
            None => quantize_tensors(w, n, k, format, Fit::Refine, dtype)?,
        };
        // shared: the cache and the graphs hold the same bytes
        let made = made.map(Tensor::into_shared);
        self.done.insert(key, made.clone());
        Ok((made, false))
    }

    /// [`Quantizer::made`] of stacked expert weights `t` (`w`): `W [E, N,
    /// K]` in `format` as `E·N` rows of K, each group fitted as a linear's
    /// (no calibration: the statistics are the linears'), the three tensors
    /// with the expert dim in front.
    fn made_stacked(
        &mut self,
        name: &str,
        t: &Tensor,
        w: &experts::Stacked,
        format: QuantFormat,
    ) -> Result<([Tensor; 3], bool)> {
        let key = (name.to_string(), w.transposed, format, bytes_hash(t));
        if let Some(made) = self.done.get(&key) {
            return Ok((made.clone(), true));
        }
        let (e, n, k) = (w.e, w.n, w.k);
        let owned;
        let values = match w.transposed {
            false => Values::Tensor(t),
            true => {
                owned = experts::stacked_values(t, [e, k, n]);
                Values::F32(&owned)
            }
        };
        let made = quantize_tensors(values, e * n, k, format, Fit::Refine, t.dtype())
            .map_err(|err| err.context(format!("quantizing `{name}`")))?;
        let made = made.map(|q| {
            let last = q.shape()[1];
            // (shared first: the reshape then shares the bytes)
            q.into_shared().reshape(&[e, n, last])
        });
        let [packed, scales, zeros] = made;
        let made = [packed?, scales?, zeros?];
        self.done.insert(key, made.clone());
        Ok((made, false))
    }

    /// Why the routed products by stacked weight `name` of `k` input
    /// channels (node `node`) stay in float, if they do.
    fn expert_skip(&self, name: &str, node: &str, k: usize) -> Option<String> {
        if self.options.scheme == Scheme::Int8 {
            return Some(
                "gather_qmv, the routed-expert kernel, takes int4 codes only: under int8 the experts stay in float"
                    .into(),
            );
        }
        let skip = self.options.skip.iter();
        if let Some(p) = skip
            .clone()
            .find(|p| name.contains(p.as_str()) || node.contains(p.as_str()))
        {
            return Some(format!("matches --quantize-skip {p}"));
        }
        if let Err(e) = self.expert_format().check_group(k) {
            return Some(e.message().to_string());
        }
        self.float_experts.get(name).cloned()
    }

    /// The group size of stacked expert weights in int4.
    pub fn expert_group(&self) -> usize {
        self.expert_format().group_size
    }

    /// The format of stacked expert weights: int4 in the scheme's groups
    /// (mixed too: `gather_qmv` has no int8 form, and the experts are not
    /// measured).
    fn expert_format(&self) -> QuantFormat {
        QuantFormat::int4(self.options.group_size.unwrap_or(INT4_GROUP))
    }

    /// The routed products of `graph` ([`experts`]) whose stacked weights
    /// may go to int4 become `gather_qmv`; the others are reported.
    fn quantize_experts(&mut self, graph: &mut Graph, report: &mut QuantizeReport) -> Result<()> {
        let products = experts::routed_products(graph);
        if products.is_empty() {
            return Ok(());
        }
        let weights: Vec<ValueId> = products.iter().map(|p| p.weight.value).collect();
        let mut outside = experts::float_readers(graph, &products, weights);
        // a weight one of whose products stays in float (a skip pattern
        // naming the node) stays in float in all of them
        for p in &products {
            let node = &graph.nodes[p.anchor].name;
            let name = weight_name(graph, p.weight.value);
            if let Some(why) = self.expert_skip(&name, node, p.weight.k) {
                outside.entry(p.weight.value).or_insert(why);
            }
        }
        let format = self.expert_format();
        let mut tables: HashMap<ValueId, QuantTable> = HashMap::new();
        let mut rewritten: HashMap<usize, (experts::RoutedProduct, QuantTable)> = HashMap::new();
        for p in products {
            let node = graph.nodes[p.anchor].name.clone();
            let w = p.weight.value;
            let name = weight_name(graph, w);
            if let Some(why) = outside.get(&w).cloned() {
                report.experts_skipped.push((node, name, why));
                continue;
            }
            let table = match tables.get(&w) {
                Some(&table) => table,
                None => {
                    let ([packed, scales, zeros], _) =
                        self.made_stacked(&name, &graph.constants[&w], &p.weight, format)?;
                    let tag = format.name();
                    let table = QuantTable {
                        packed: graph.add_constant(format!("{name}.{tag}"), packed),
                        scales: graph.add_constant(format!("{name}.{tag}_scales"), scales),
                        zeros: graph.add_constant(format!("{name}.{tag}_zeros"), zeros),
                        format,
                    };
                    tables.insert(w, table);
                    table
                }
            };
            report.experts.push((node, name));
            rewritten.insert(p.anchor, (p, table));
        }
        if rewritten.is_empty() {
            return Ok(());
        }
        let nodes = std::mem::take(&mut graph.nodes);
        let mut out = Vec::with_capacity(nodes.len());
        for (i, node) in nodes.into_iter().enumerate() {
            match rewritten.remove(&i) {
                Some((p, table)) => out.extend(experts::rewrite(graph, &node, &p, table)?),
                None => out.push(node),
            }
        }
        graph.nodes = out;
        Ok(())
    }

    /// Quantize the linears of `graph` (see the module comment).
    pub fn quantize(&mut self, graph: &mut Graph) -> Result<QuantizeReport> {
        self.options.check()?;
        let mut report = QuantizeReport::default();
        self.quantize_experts(graph, &mut report)?;
        let candidates: HashMap<String, Candidate> = self
            .candidates(graph)
            .into_iter()
            .map(|c| (c.node.clone(), c))
            .collect();
        // quantized tables by weight value: (packed, scales, zeros, format)
        let mut tables: HashMap<ValueId, (ValueId, ValueId, ValueId, QuantFormat)> = HashMap::new();
        let mut nodes = Vec::with_capacity(graph.nodes.len());
        for node in std::mem::take(&mut graph.nodes) {
            let found = match node.op {
                Op::Linear | Op::MatMul => candidates.get(&node.name),
                _ => None,
            };
            let Some(c) = found else {
                nodes.push(node);
                continue;
            };
            let (name, weight) = match &c.weight {
                Ok(found) => found,
                Err(why) => {
                    report.skipped.push((node.name.clone(), why.clone()));
                    nodes.push(node);
                    continue;
                }
            };
            let LinearWeight {
                value: w,
                transposed,
                k,
                ..
            } = *weight;
            let format = self.options.format(k, self.int8.contains(name));
            let ([packed, scales, zeros], reused) =
                self.made(name, &graph.constants[&w], transposed, format, None)?;
            if reused {
                report.reused.push(node.name.clone());
            }
            if self
                .calibration
                .is_some_and(|cal| cal.stats.contains_key(name))
            {
                report.calibrated.push(node.name.clone());
            }
            let tag = format.name();
            let packed = graph.add_constant(format!("{name}.{tag}"), packed);
            let scales = graph.add_constant(format!("{name}.{tag}_scales"), scales);
            let zeros = graph.add_constant(format!("{name}.{tag}_zeros"), zeros);
            if !transposed {
                tables.entry(w).or_insert((packed, scales, zeros, format));
            }
            let x = node.inputs[0];
            let bias = match node.op {
                Op::Linear => node.inputs.get(2).copied().flatten(),
                _ => None,
            };
            let quant = |outputs: Vec<ValueId>| Node {
                name: node.name.clone(),
                target: node.target.clone(),
                op: format.linear_op(),
                inputs: vec![x, Some(packed), Some(scales), Some(zeros)],
                outputs,
            };
            match bias {
                None => nodes.push(quant(node.outputs.clone())),
                Some(b) => {
                    let out = node.outputs[0];
                    let info = graph.value(out).clone();
                    let mm =
                        graph.add_value(format!("{}.{tag}_mm", node.name), info.dtype, info.shape);
                    if let Some(dims) = graph.sym.dims.get(&out).cloned() {
                        graph.sym.dims.insert(mm, dims); // the sum has the product's sizes
                    }
                    nodes.push(quant(vec![mm]));
                    nodes.push(Node {
                        name: format!("{}.bias", node.name),
                        target: node.target.clone(),
                        op: Op::Binary(BinaryOp::Add),
                        inputs: vec![Some(mm), Some(b)],
                        outputs: vec![out],
                    });
                }
            }
            report.quantized.push((node.name.clone(), format));
        }
        graph.nodes = nodes;
        quantized_embeddings(graph, &tables, &mut report)?;
        eliminate_dead_code(graph);
        Ok(report)
    }
}

/// The stacked expert weights (by name) that some graph of `graphs` reads
/// other than by a routed product, with why ([`experts::float_readers`]
/// over every graph, for the weights some graph routes).
fn float_experts(graphs: &[&Graph]) -> HashMap<String, String> {
    let routed: Vec<Vec<experts::RoutedProduct>> =
        graphs.iter().map(|g| experts::routed_products(g)).collect();
    let names: HashSet<String> = (graphs.iter().zip(&routed))
        .flat_map(|(g, ps)| ps.iter().map(|p| weight_name(g, p.weight.value)))
        .collect();
    let mut out = HashMap::new();
    if names.is_empty() {
        return out;
    }
    for (g, products) in graphs.iter().zip(&routed) {
        let weights = (g.constants.keys().copied()).filter(|&v| names.contains(&weight_name(g, v)));
        for (w, why) in experts::float_readers(g, products, weights) {
            out.entry(weight_name(g, w)).or_insert(why);
        }
    }
    out
}

/// Quantize every linear of `graph` to int4 in groups of `group_size`
/// (see the module comment), without calibration.
pub fn quantize_int4(
    graph: &mut Graph,
    group_size: usize,
    skip_patterns: &[String],
) -> Result<QuantizeReport> {
    Quantizer::new(QuantizeOptions::int4(group_size, skip_patterns), None).quantize(graph)
}

/// Every embedding whose table is the weight of a quantized linear (not
/// transposed: a head tied to the embedding) gathers the rows of the
/// quantized table instead ([`quantized_gather`]).
fn quantized_embeddings(
    graph: &mut Graph,
    tables: &HashMap<ValueId, (ValueId, ValueId, ValueId, QuantFormat)>,
    report: &mut QuantizeReport,
) -> Result<()> {
    if tables.is_empty() {
        return Ok(());
    }
    let nodes = std::mem::take(&mut graph.nodes);
    let mut out = Vec::with_capacity(nodes.len());
    for node in nodes {
        let table = match (&node.op, node.inputs.first()) {
            (Op::Embedding, Some(Some(t))) => tables.get(t).copied(),
            _ => None,
        };
        let (Some(table), Some(Some(idx))) = (table, node.inputs.get(1)) else {
            out.push(node);
            continue;
        };
        let idx = *idx;
        report.embeddings.push(node.name.clone());
        out.extend(quantized_gather(graph, &node, idx, table)?);
    }
    graph.nodes = out;
    Ok(())
}

/// What builds the nodes of a rewrite: a pass's [`Rewrite`], or the
/// importer's lowering of one source node.
pub(crate) trait Build {
    fn graph(&self) -> &Graph;
    /// A node computing `op`, its output inferred.
    fn node(&mut self, op: Op, inputs: &[Option<ValueId>]) -> Result<ValueId>;
    /// A new constant (`what` names it).
    fn constant(&mut self, what: &str, t: Tensor) -> ValueId;
}

impl Build for Rewrite<'_> {
    fn graph(&self) -> &Graph {
        self.graph
    }
    fn node(&mut self, op: Op, inputs: &[Option<ValueId>]) -> Result<ValueId> {
        Rewrite::node(self, op, inputs)
    }
    fn constant(&mut self, what: &str, t: Tensor) -> ValueId {
        Rewrite::constant(self, what, t)
    }
}

/// A quantized table `W [V, K]`: its int32 words, scales and zeros.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QuantTable {
    pub packed: ValueId,
    pub scales: ValueId,
    pub zeros: ValueId,
    pub format: QuantFormat,
}

/// `embedding(W, idx)` of a quantized `W [V, K]` (int32 words `[V, K/c]`,
/// `c` codes a word), as `dtype`: the words of the rows, each code taken
/// out as `floor(word / 2^(b·i)) mod 2^b` (Python's floor division and
/// remainder take the two's-complement bits of a negative word exactly),
/// then `code · scale + zero` per group, in f32, cast to `dtype`. Ops
/// every backend has: the GPU fuses them into the gather. The value of
/// the rows `[idx…, K]`.
pub(crate) fn gather_rows(
    b: &mut dyn Build,
    table: QuantTable,
    idx: ValueId,
    dtype: DType,
) -> Result<ValueId> {
    let g = b.graph();
    let lead = g.value(idx).shape.clone();
    let (per, gs) = (table.format.per_word(), table.format.group_size);
    let k = g.value(table.packed).shape.last().copied().unwrap_or(0) * per;
    let at = |tail: &[usize]| [lead.clone(), tail.to_vec()].concat();
    let reshape = |b: &mut dyn Build, x: ValueId, shape: Vec<usize>| match b.graph().value(x).shape
        == shape
    {
        true => Ok(x),
        false => b.node(Op::Reshape { shape }, &[Some(x)]),
    };
    let words = b.node(Op::Embedding, &[Some(table.packed), Some(idx)])?;
    let words = reshape(b, words, at(&[k / per, 1]))?;
    let bits = table.format.bits as usize;
    let steps: Vec<i64> = (0..per).map(|i| 1i64 << (bits * i)).collect();
    let steps = b.constant("code_steps", Tensor::from_i64(DType::I32, &[per], &steps)?);
    let shifted = b.node(Op::Binary(BinaryOp::FloorDiv), &[Some(words), Some(steps)])?;
    let levels = b.constant(
        "code_levels",
        Tensor::from_i64(DType::I32, &[], &[1i64 << bits])?,
    );
    let codes = b.node(
        Op::Binary(BinaryOp::Remainder),
        &[Some(shifted), Some(levels)],
    )?;
    let codes = b.node(Op::Cast { dtype: DType::F32 }, &[Some(codes)])?;
    let mut affine = reshape(b, codes, at(&[k / gs, gs]))?;
    for (part, op) in [(table.scales, BinaryOp::Mul), (table.zeros, BinaryOp::Add)] {
        let mut rows = b.node(Op::Embedding, &[Some(part), Some(idx)])?;
        if b.graph().value(rows).dtype != DType::F32 {
            rows = b.node(Op::Cast { dtype: DType::F32 }, &[Some(rows)])?;
        }
        let rows = reshape(b, rows, at(&[k / gs, 1]))?;
        affine = b.node(Op::Binary(op), &[Some(affine), Some(rows)])?;
    }
    let flat = reshape(b, affine, at(&[k]))?;
    match dtype {
        DType::F32 => Ok(flat),
        _ => b.node(Op::Cast { dtype }, &[Some(flat)]),
    }
}

/// `embedding(W, idx)` rewritten to [`gather_rows`] of the quantized `W`.
fn quantized_gather(
    graph: &mut Graph,
    node: &Node,
    idx: ValueId,
    (packed, scales, zeros, format): (ValueId, ValueId, ValueId, QuantFormat),
) -> Result<Vec<Node>> {
    let dtype = graph.value(node.outputs[0]).dtype;
    let table = QuantTable {
        packed,
        scales,
        zeros,
        format,
    };
    let mut rw = Rewrite::new(graph, node);
    let y = gather_rows(&mut rw, table, idx, dtype)?;
    rw.finish(y)
}

#[cfg(test)]
mod tests {
    use super::fit::tests::gaussian;
    use super::*;
    use crate::eval::run_graph;
    use crate::ir::OutputKind;
    use crate::test_util::{ops, push, reinfers};

    fn mlp(k: usize) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![3, k]);
        g.inputs.push((x, InputKind::User));
        let w1 = g.add_value("p_fc_weight", DType::F32, vec![64, k]);
        g.inputs.push((
            w1,
            InputKind::Parameter {
                fqn: "fc.weight".into(),
            },
        ));
        g.constants.insert(
            w1,
            Tensor::from_f32(DType::F32, &[64, k], &gaussian(1, 64 * k)).unwrap(),
        );
        let b1 = g.add_constant(
            "b",
            Tensor::from_f32(DType::F32, &[64], &[0.5; 64]).unwrap(),
        );
        let h = push(&mut g, "fc", Op::Linear, vec![Some(x), Some(w1), Some(b1)]);
        let w2 = g.add_constant(
            "lm_head",
            Tensor::from_f32(DType::F32, &[64, 16], &gaussian(2, 1024)).unwrap(),
        );
        let y = push(&mut g, "head", Op::MatMul, vec![Some(h), Some(w2)]);
        g.outputs.push((y, OutputKind::User));
        g
    }

    #[test]
    fn linears_and_constant_matmuls_become_int4() {
        let mut g = mlp(64);
        let r = quantize_int4(&mut g, 32, &[]).unwrap();
        assert_eq!(r.nodes(), ["fc", "head"]);
        assert_eq!(ops(&g), ["int4_linear", "add", "int4_linear"]);
        reinfers(&g);
        // The float weights are gone; the head's B [64, 16] is W [16, 64].
        assert!(g.inputs.iter().all(|(_, k)| *k == InputKind::User));
        let packed = g.nodes[2].inputs[1].unwrap();
        assert_eq!(
            (g.value(packed).dtype, &g.value(packed).shape[..]),
            (DType::I32, &[16, 8][..])
        );
        assert_eq!(g.value(g.nodes[2].inputs[2].unwrap()).shape, [16, 2]);
    }

    #[test]
    fn a_quantizer_quantizes_shared_weights_once() {
        let mut cache = Quantizer::new(QuantizeOptions::int4(32, &[]), None);
        let (mut a, mut b) = (mlp(64), mlp(64));
        let ra = cache.quantize(&mut a).unwrap();
        let rb = cache.quantize(&mut b).unwrap();
        assert!(ra.reused.is_empty());
        assert_eq!(
            (&rb.quantized, rb.reused.clone()),
            (
                &ra.quantized,
                ra.nodes().iter().map(|s| s.to_string()).collect()
            )
        );
        let constants = |g: &Graph| {
            let mut c: Vec<_> = g
                .constants
                .iter()
                .map(|(v, t)| (g.value(*v).name.clone(), t.bytes().to_vec()))
                .collect();
            c.sort();
            c
        };
        assert_eq!(constants(&a), constants(&b));
        // same names, other values: quantized anew
        let mut c = mlp(64);
        let fc = c.nodes[0].inputs[1].unwrap();
        let t = Tensor::from_f32(DType::F32, &[64, 64], &gaussian(9, 64 * 64)).unwrap();
        c.constants.insert(fc, t);
        let rc = cache.quantize(&mut c).unwrap();
        assert_eq!(rc.reused, ["head"]);
    }

    /// Two linears of one input (`q` without bias, `k` with one),
    /// quantized and then merged (`crate::siblings`, as the compile does):
    /// one int4 product of the weights concatenated along N, its output
    /// sliced at each part's offset, the bias added after the slice.
    #[test]
    fn linears_of_one_input_become_one_int4_product() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![3, 64]);
        g.inputs.push((x, InputKind::User));
        let (wq, wk) = (gaussian(3, 64 * 64), gaussian(4, 32 * 64));
        let q_w = g.add_constant("q", Tensor::from_f32(DType::F32, &[64, 64], &wq).unwrap());
        let k_w = g.add_constant("k", Tensor::from_f32(DType::F32, &[32, 64], &wk).unwrap());
        let b = g.add_constant(
            "b",
            Tensor::from_f32(DType::F32, &[32], &[0.5; 32]).unwrap(),
        );
        let q = push(&mut g, "q_proj", Op::Linear, vec![Some(x), Some(q_w)]);
        let k = push(
            &mut g,
            "k_proj",
            Op::Linear,
            vec![Some(x), Some(k_w), Some(b)],
        );
        g.outputs.push((q, OutputKind::User));
        g.outputs.push((k, OutputKind::User));
        let r = quantize_int4(&mut g, 32, &[]).unwrap();
        crate::siblings::merge(&mut g).unwrap();
        assert_eq!(r.nodes(), ["q_proj", "k_proj"]);
        assert_eq!(ops(&g), ["int4_linear", "slice", "slice", "add"]);
        reinfers(&g);
        let slices: Vec<_> = g.nodes[1..3].iter().map(|n| n.op.clone()).collect();
        let slice = |start, end| Op::Slice {
            dim: 1,
            start,
            end,
            step: 1,
        };
        assert_eq!(slices, [slice(0, 64), slice(64, 96)]);
        assert_eq!(g.nodes[1].outputs, [q]);
        // the parts' int4 weights, one after the other
        let parts = [(&wq, 64), (&wk, 32)].map(|(w, n)| {
            quantize_weight(w, n, 64, QuantFormat::int4(32), Fit::Refine, DType::F32).unwrap()
        });
        let packed: Vec<u8> = parts.iter().flat_map(|p| p.packed.clone()).collect();
        let scales: Vec<f32> = parts.iter().flat_map(|p| p.scales.clone()).collect();
        let merged = |slot: usize| &g.constants[&g.nodes[0].inputs[slot].unwrap()];
        let words = as_words(&Tensor::from_slice(DType::U8, &[96, 32], &packed).unwrap());
        assert_eq!(merged(1).bytes(), words.unwrap().bytes());
        assert_eq!(merged(2).to_f32_vec(), scales);
    }

    #[test]
    fn skips_are_reported() {
        let mut g = mlp(48);
        let r = quantize_int4(&mut g, 32, &["lm_head".into()]).unwrap();
        assert!(r.quantized.is_empty());
        assert_eq!(r.skipped[0].0, "fc");
        assert!(
            r.skipped[0].1.contains("does not divide K = 48"),
            "{:?}",
            r.skipped
        );
        assert!(
            r.skipped[1].1.contains("--quantize-skip lm_head"),
            "{:?}",
            r.skipped
        );
        assert_eq!(ops(&g), ["linear", "mat_mul"]);
        let mut g = mlp(64);
        let r = quantize_int4(&mut g, 32, &["fc.".into()]).unwrap();
        assert_eq!(
            r.skipped,
            [("fc".to_string(), "matches --quantize-skip fc.".to_string())]
        );
        assert_eq!(r.nodes(), ["head"]);
        assert!(quantize_int4(&mut g, 48, &[]).is_err());
    }

    /// int8 per output channel (one group of all of K), the head's `B`
    /// transposed; per group with a group size; a K that is no multiple
    /// of 32 stays in float, named.
    #[test]
    fn int8_is_per_channel_or_per_group() {
        let options = |group_size| QuantizeOptions {
            scheme: Scheme::Int8,
            group_size,
            skip: vec![],
        };
        let mut g = mlp(64);
        let r = Quantizer::new(options(None), None)
            .quantize(&mut g)
            .unwrap();
        assert_eq!(
            r.quantized,
            [
                ("fc".into(), QuantFormat::int8(64)),
                ("head".into(), QuantFormat::int8(64))
            ]
        );
        assert_eq!(ops(&g), ["int8_linear", "add", "int8_linear"]);
        reinfers(&g);
        let packed = g.nodes[2].inputs[1].unwrap();
        assert_eq!(
            (g.value(packed).dtype, &g.value(packed).shape[..]),
            (DType::I32, &[16, 16][..])
        );
        assert_eq!(g.value(g.nodes[2].inputs[2].unwrap()).shape, [16, 1]);
        let mut g = mlp(64);
        let r = Quantizer::new(options(Some(32)), None)
            .quantize(&mut g)
            .unwrap();
        assert_eq!(r.quantized[0].1, QuantFormat::int8(32));
        assert_eq!(g.value(g.nodes[0].inputs[2].unwrap()).shape, [64, 2]);
        let mut g = mlp(48);
        let r = Quantizer::new(options(None), None)
            .quantize(&mut g)
            .unwrap();
        assert_eq!(r.skipped[0].0, "fc");
        assert!(
            r.skipped[0].1.contains("int8 group size 48"),
            "{:?}",
            r.skipped
        );
        let bad = options(Some(48)).check().unwrap_err();
        assert!(bad.to_string().contains("--group-size 48"), "{bad}");
    }

    /// A head tied to the embedding: the gather reads the rows of the
    /// head's quantized table (no float table left), and computes what
    /// the dequantized table holds, for both code widths.
    #[test]
    fn a_tied_embedding_gathers_the_quantized_rows() {
        let (vocab, k) = (40, 64);
        for scheme in [Scheme::Int4, Scheme::Int8] {
            let mut g = Graph::default();
            let ids = g.add_value("ids", DType::I64, vec![1, 3]);
            g.inputs.push((ids, InputKind::User));
            let table = g.add_value("p_embed", DType::F32, vec![vocab, k]);
            g.inputs.push((
                table,
                InputKind::Parameter {
                    fqn: "embed.weight".into(),
                },
            ));
            let w = gaussian(8, vocab * k);
            g.constants.insert(
                table,
                Tensor::from_f32(DType::F32, &[vocab, k], &w).unwrap(),
            );
            let h = push(&mut g, "embed", Op::Embedding, vec![Some(table), Some(ids)]);
            let y = push(&mut g, "lm_head", Op::Linear, vec![Some(h), Some(table)]);
            g.outputs.push((h, OutputKind::User));
            g.outputs.push((y, OutputKind::User));
            let options = QuantizeOptions {
                scheme,
                group_size: None,
                skip: vec![],
            };
            let r = Quantizer::new(options, None).quantize(&mut g).unwrap();
            assert_eq!(r.embeddings, ["embed"], "{scheme:?}");
            reinfers(&g);
            assert!(
                !g.constants.contains_key(&table),
                "{scheme:?}: the float table is left"
            );
            assert!(
                ops(&g).iter().filter(|o| **o == "embedding").count() == 3,
                "{:?}",
                ops(&g)
            );
            // run it: the rows are the dequantized table's
            let tokens = Tensor::from_i64(DType::I64, &[1, 3], &[0, 39, 7]).unwrap();
            let out = run_graph(&g, vec![tokens]).unwrap();
            let format = r.quantized[0].1;
            let q = quantize_weight(&w, vocab, k, format, Fit::Refine, DType::F32).unwrap();
            let deq = dequantize_weight(&q, k);
            let rows: Vec<f32> = [0, 39, 7]
                .iter()
                .flat_map(|&i| deq[i * k..(i + 1) * k].to_vec())
                .collect();
            assert_eq!(out[0].to_f32_vec(), rows, "{scheme:?}");
        }
    }

    /// `mixed` measures every weight and puts the most sensitive ones in
    /// int8 per channel; its plan holds in every graph it quantizes.
    #[test]
    fn mixed_puts_the_most_sensitive_weights_in_int8() {
        let options = QuantizeOptions {
            scheme: Scheme::Mixed,
            group_size: None,
            skip: vec![],
        };
        let mut q = Quantizer::new(options, None);
        // fc [64, 32] (2048 elements) fits int8's share of the 3072
        let (mut a, mut b) = (mlp(32), mlp(32));
        // fc's weight: heavy outliers make its int4 error larger
        let fc = a.nodes[0].inputs[1].unwrap();
        let mut w = gaussian(1, 64 * 32);
        for (i, v) in w.iter_mut().enumerate() {
            if i % 7 == 0 {
                *v *= 30.0;
            }
        }
        let t = Tensor::from_f32(DType::F32, &[64, 32], &w).unwrap();
        a.constants.insert(fc, t.clone());
        b.constants.insert(fc, t);
        q.plan(&[&a, &b], None).unwrap();
        assert_eq!(q.sensitivity.len(), 2, "{:?}", q.sensitivity);
        assert_eq!(q.sensitivity[0].weight, "fc.weight");
        assert!(
            q.sensitivity[0].int8 && !q.sensitivity[1].int8,
            "{:?}",
            q.sensitivity
        );
        for g in [&mut a, &mut b] {
            let r = q.quantize(g).unwrap();
            assert_eq!(
                r.quantized,
                [
                    ("fc".into(), QuantFormat::int8(32)),
                    ("head".into(), QuantFormat::int4(32))
                ]
            );
        }
    }

    /// A measure given to `plan` ranks the weights instead of their
    /// relative error: it sees each weight's dequantized int4 values.
    #[test]
    fn mixed_ranks_by_the_measure_given() {
        let options = QuantizeOptions {
            scheme: Scheme::Mixed,
            group_size: None,
            skip: vec![],
        };
        let mut q = Quantizer::new(options, None);
        let mut g = mlp(32);
        let mut seen = vec![];
        let mut measure = |name: &str, w: &[f32], n: usize, k: usize| {
            assert_eq!(w.len(), n * k);
            seen.push((name.to_string(), n, k));
            Ok(Some(if name == "lm_head" { 1.0 } else { 0.1 }))
        };
        q.plan(&[&g], Some(&mut measure)).unwrap();
        assert_eq!(
            seen,
            [
                ("fc.weight".to_string(), 64, 32),
                ("lm_head".into(), 16, 64)
            ]
        );
        assert_eq!(q.sensitivity[0].weight, "lm_head");
        assert!(q.sensitivity[0].int8 && !q.sensitivity[1].int8);
        let r = q.quantize(&mut g).unwrap();
        assert_eq!(
            r.quantized,
            [
                ("fc".into(), QuantFormat::int4(32)),
                ("head".into(), QuantFormat::int8(64))
            ]
        );
    }
}
