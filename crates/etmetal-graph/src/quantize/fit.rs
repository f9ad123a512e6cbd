//! Round to nearest: each group's scale and zero fitted to its values
//! alone (no calibration), for either code width.
//!
//! Each group (`w = code * scale + zero`, codes `0..=max`, max 15 or 255)
//! is fitted by:
//! 1. asymmetric min-max (`zero = min`, `scale = (max - min) / max_code`);
//! 2. refinement: alternately refit scale and zero by least squares to the
//!    codes and re-round the codes, keeping a group's new parameters only
//!    while its squared error drops (HQQ refines the zero with an l_p,
//!    p < 1, proximal step; we minimise l_2, the error the matmul sees);
//! 3. scale and zero rounded to the stored dtype, and the codes re-rounded
//!    to those stored values (the grid the kernels read).
//!
//! int4, relative error `|W - Ŵ|² / |W|²` (group 32, 256x4096): gaussian
//! min-max 6.12e-3, refined 5.23e-3; student-t(3) 8.35e-3, 6.97e-3.
//! The module comment of `quantize` has what these choices cost a model.

use etmetal_core::quant::{pack_into, unpack, QuantFormat};
use etmetal_core::{DType, Error, Result, Tensor};
use rayon::prelude::*;

/// Least-squares refinement rounds per group: the error stops dropping
/// after 3-4 on gaussian and heavy-tailed weights.
const REFINE_ROUNDS: usize = 6;

/// How [`quantize_weight`] fits each group's scale and zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// `zero = min`, `scale = (max - min) / max_code`.
    MinMax,
    /// Min-max, then least-squares refinement: what `--quantize` uses.
    Refine,
}

/// A quantized weight `[N, K]`: packed codes `[N, K·bits/8]`, scales and
/// zeros `[N, K/group]` (as stored: rounded to the scale dtype).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantWeight {
    pub format: QuantFormat,
    pub packed: Vec<u8>,
    pub scales: Vec<f32>,
    pub zeros: Vec<f32>,
}

/// Codes of one group for `scale`, `zero` (codes `0..=max`), and their
/// squared error (summed in order, after the codes: the code loop has no
/// carried dependency, so it runs at the throughput of its instructions).
pub(super) fn codes(w: &[f32], scale: f32, zero: f32, max: f32, q: &mut [u8]) -> f64 {
    let inv = 1.0 / scale;
    for (v, c) in w.iter().zip(q.iter_mut()) {
        *c = code((v - zero) * inv, max);
    }
    let mut err = 0.0f64;
    for (v, &c) in w.iter().zip(q.iter()) {
        let d = (c as f32 * scale + zero - v) as f64;
        err += d * d;
    }
    err
}

/// `x.round().clamp(0.0, max) as u8` (half away from zero; NaN gives 0)
/// for a code range `max` of 15 or 255, without `round`'s library call
/// (x86-64 has no rounding instruction before SSE4.1, and the fit rounds
/// every value of every group several times): `x` clamped to
/// `0..=max + 1` first (NaN to 0) rounds as it would unclamped, and there
/// `x` less its truncation is exact, so comparing it with one half decides
/// the rounding. Equal to the `round` form for every `f32` (checked over
/// all of them for both ranges when it was written, 2^33 roundings;
/// `code_is_round_and_clamp` samples them on every test run).
#[inline]
fn code(x: f32, max: f32) -> u8 {
    let y = x.max(0.0).min(max + 1.0);
    // SAFETY: `y` is in 0..=256, which an i32 holds
    let t = unsafe { y.to_int_unchecked::<i32>() };
    let r = t + (y - t as f32 >= 0.5) as i32;
    r.min(max as i32) as u8
}

/// What least squares needs of a group's values `w` and codes `q`, each
/// summed in f64 in the order of the values: `Σq`, `Σq²` (integers, exact
/// in any order), `Σw` and `Σq·w`.
#[derive(Clone, Copy)]
struct Sums {
    sq: f64,
    sqq: f64,
    sw: f64,
    sqw: f64,
}

/// [`codes`] into `q`, their squared error and their [`Sums`] (`sw`: `Σw`,
/// the same for every set of codes), in one pass after the codes: the error
/// and `Σq·w` are two independent chains of additions.
fn codes_and_sums(
    w: &[f32],
    scale: f32,
    zero: f32,
    max: f32,
    q: &mut [u8],
    sw: f64,
) -> (f64, Sums) {
    let inv = 1.0 / scale;
    for (v, c) in w.iter().zip(q.iter_mut()) {
        *c = code((v - zero) * inv, max);
    }
    let (mut err, mut sqw) = (0.0f64, 0.0f64);
    for (&v, &c) in w.iter().zip(q.iter()) {
        let d = (c as f32 * scale + zero - v) as f64;
        err += d * d;
        sqw += c as f64 * v as f64;
    }
    let (mut sq, mut sqq) = (0u64, 0u64);
    for &c in q.iter() {
        sq += c as u64;
        sqq += c as u64 * c as u64;
    }
    let sums = Sums {
        sq: sq as f64,
        sqq: sqq as f64,
        sw,
        sqw,
    };
    (err, sums)
}

/// The `(scale, zero)` minimising the squared error of `n` values for the
/// codes whose [`Sums`] these are; None when the codes do not determine a
/// positive scale.
fn least_squares(n: usize, s: Sums) -> Option<(f32, f32)> {
    let n = n as f64;
    let det = n * s.sqq - s.sq * s.sq;
    if det <= 0.0 {
        return None;
    }
    let scale = (n * s.sqw - s.sq * s.sw) / det;
    (scale > 1e-12).then(|| (scale as f32, ((s.sw - scale * s.sq) / n) as f32))
}

/// `(scale, zero)` of one group with codes `0..=max`, its codes written
/// into `q`; `trial` is scratch of the group's length.
pub(super) fn fit_group(
    w: &[f32],
    max: f32,
    fit: Fit,
    q: &mut [u8],
    trial: &mut [u8],
) -> (f32, f32) {
    let (lo, hi) = w
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let mut best = (((hi - lo) / max).max(1e-8), lo);
    if fit == Fit::MinMax {
        codes(w, best.0, best.1, max, q);
        return best;
    }
    let sw = w.iter().fold(0.0f64, |s, &v| s + v as f64);
    let (mut best_err, mut sums) = codes_and_sums(w, best.0, best.1, max, q, sw);
    // Refinement: refit to the codes, re-round the codes, while the error
    // drops.
    for _ in 0..REFINE_ROUNDS {
        let Some((scale, zero)) = least_squares(w.len(), sums) else {
            break;
        };
        let (err, next) = codes_and_sums(w, scale, zero, max, trial, sw);
        if err >= best_err {
            break;
        }
        (best, best_err, sums) = ((scale, zero), err, next);
        q.copy_from_slice(trial);
    }
    best
}

/// `v` as `dtype` holds it (the stored scales and zeros).
pub(super) fn stored(dtype: DType, v: &[f32]) -> Result<Vec<f32>> {
    Ok(Tensor::from_f32(dtype, &[v.len()], v)?.to_f32_vec())
}

/// Rows `0..n` in parallel chunks on every core: `f(first_row, rows)`.
pub(super) fn par_rows<T: Send>(n: usize, f: impl Fn(usize, usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let per = n.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .step_by(per)
            .map(|r0| {
                let f = &f;
                scope.spawn(move || f(r0, per.min(n - r0)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a quantizing thread panicked"))
            .collect()
    })
}

/// Groups one task quantizes: the tasks, and so the results, are the
/// same whatever the number of threads.
const TASK_GROUPS: usize = 1024;

/// Where [`quantize_groups`] reads a weight `[N, K]` (row-major) from.
#[derive(Clone, Copy)]
pub(super) enum Values<'a> {
    F32(&'a [f32]),
    /// A float tensor, converted a task's groups at a time
    /// ([`Tensor::read_f32`]): no f32 copy of the whole weight.
    Tensor(&'a Tensor),
}

impl Values<'_> {
    /// Values `start..start + len`, borrowed or converted into `scratch`.
    fn get<'s>(&'s self, start: usize, len: usize, scratch: &'s mut Vec<f32>) -> &'s [f32] {
        match self {
            Values::F32(w) => &w[start..start + len],
            Values::Tensor(t) => {
                scratch.resize(len, 0.0);
                t.read_f32(start, scratch);
                scratch
            }
        }
    }
}

/// Quantize the groups of `w` in `format`, in parallel tasks of
/// [`TASK_GROUPS`] groups, each fitted ([`fit_group`]), its scale and zero
/// rounded to `dtype` ([`stored`]) and its codes rounded to those and
/// packed: `packed` gets the codes (`bits / 8` bytes a value), `scales`
/// and `zeros` the stored parameters (one a group).
fn quantize_groups(
    w: Values,
    format: QuantFormat,
    fit: Fit,
    dtype: DType,
    packed: &mut [u8],
    scales: &mut [f32],
    zeros: &mut [f32],
) -> Result<()> {
    let gs = format.group_size;
    let max = format.max_code() as f32;
    let group_bytes = gs / format.per_byte();
    packed
        .par_chunks_mut(TASK_GROUPS * group_bytes)
        .zip(scales.par_chunks_mut(TASK_GROUPS))
        .zip(zeros.par_chunks_mut(TASK_GROUPS))
        .enumerate()
        .try_for_each_init(
            || (vec![], vec![0u8; gs], vec![0u8; gs]),
            |(scratch, q, trial), (task, ((packed, scales), zeros))| -> Result<()> {
                let w = w.get(task * TASK_GROUPS * gs, scales.len() * gs, scratch);
                for ((wg, s), z) in w.chunks_exact(gs).zip(&mut *scales).zip(&mut *zeros) {
                    (*s, *z) = fit_group(wg, max, fit, q, trial);
                }
                scales.copy_from_slice(&stored(dtype, scales)?);
                zeros.copy_from_slice(&stored(dtype, zeros)?);
                let groups = w.chunks_exact(gs).zip(packed.chunks_exact_mut(group_bytes));
                for (((wg, pg), &s), &z) in groups.zip(&*scales).zip(&*zeros) {
                    codes(wg, s, z, max, q);
                    pack_into(format.bits, q, pg);
                }
                Ok(())
            },
        )
}

/// Quantize `w [N, K]` (row-major) in `format`'s groups along K, scales
/// and zeros stored in `dtype`: the codes are rounded to the stored
/// (rounded) parameters, which the kernels read.
pub fn quantize_weight(
    w: &[f32],
    n: usize,
    k: usize,
    format: QuantFormat,
    fit: Fit,
    dtype: DType,
) -> Result<QuantWeight> {
    let groups = n * (k / format.group_size);
    let mut packed = vec![0u8; groups * format.group_size / format.per_byte()];
    let (mut scales, mut zeros) = (vec![0f32; groups], vec![0f32; groups]);
    let values = Values::F32(&w[..groups * format.group_size]);
    quantize_groups(
        values,
        format,
        fit,
        dtype,
        &mut packed,
        &mut scales,
        &mut zeros,
    )?;
    Ok(QuantWeight {
        format,
        packed,
        scales,
        zeros,
    })
}

/// [`quantize_weight`] of `w [N, K]` as the graph stores it: the packed
/// codes as int32 words `[N, K / per word]`, the scales and zeros as
/// `dtype` tensors `[N, K / group]`. The bytes of
/// `as_words(Tensor::from_slice(U8, .., &q.packed))`,
/// `Tensor::from_f32(dtype, .., &q.scales)` and of the zeros, written in
/// place.
pub(super) fn quantize_tensors(
    w: Values,
    n: usize,
    k: usize,
    format: QuantFormat,
    fit: Fit,
    dtype: DType,
) -> Result<[Tensor; 3]> {
    let row_bytes = k / format.per_byte();
    if !row_bytes.is_multiple_of(4) {
        return Err(Error::shape(format!(
            "packed weight {:?}: its rows are not whole 32-bit words",
            [n, row_bytes]
        )));
    }
    let groups = k / format.group_size;
    let mut packed = Tensor::zeros(DType::I32, &[n, row_bytes / 4])?;
    let (mut scales, mut zeros) = (vec![0f32; n * groups], vec![0f32; n * groups]);
    quantize_groups(
        w,
        format,
        fit,
        dtype,
        packed.bytes_mut(),
        &mut scales,
        &mut zeros,
    )?;
    let as_dtype = |v: &[f32]| -> Result<Tensor> {
        let mut t = Tensor::zeros(dtype, &[n, groups])?;
        let size = dtype.size();
        (t.bytes_mut().par_chunks_mut(TASK_GROUPS * size))
            .zip(v.par_chunks(TASK_GROUPS))
            .try_for_each(|(out, v)| {
                out.copy_from_slice(Tensor::from_f32(dtype, &[v.len()], v)?.bytes());
                Ok(())
            })?;
        Ok(t)
    };
    Ok([packed, as_dtype(&scales)?, as_dtype(&zeros)?])
}

/// The float weight `[N, K]` a quantized weight stands for.
pub fn dequantize_weight(w: &QuantWeight, k: usize) -> Vec<f32> {
    let gs = w.format.group_size;
    let groups = k / gs;
    unpack(w.format.bits, &w.packed)
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let g = (i / k) * groups + (i % k) / gs;
            c as f32 * w.scales[g] + w.zeros[g]
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A deterministic stream of N(0, 1) samples (Box-Muller on an LCG).
    pub(crate) fn gaussian(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut uniform = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (u, v) = (uniform(), uniform());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect()
    }

    /// Student-t with 3 degrees of freedom: heavy tails as in trained weights.
    pub(crate) fn heavy_tailed(seed: u64, n: usize) -> Vec<f32> {
        let chi = gaussian(seed + 1, n * 3);
        gaussian(seed, n)
            .iter()
            .zip(chi.chunks_exact(3))
            .map(|(a, c)| {
                a / ((c[0] * c[0] + c[1] * c[1] + c[2] * c[2]) / 3.0)
                    .sqrt()
                    .max(1e-3)
            })
            .collect()
    }

    pub(crate) fn rel_error(w: &[f32], q: &QuantWeight, k: usize) -> f64 {
        let r = dequantize_weight(q, k);
        let num: f64 = w
            .iter()
            .zip(&r)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum();
        num / den
    }

    #[test]
    fn code_is_round_and_clamp() {
        let reference = |x: f32, max: f32| x.round().clamp(0.0, max) as u8;
        let mut xs = vec![
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            -0.0,
            1e-45,
            3e9,
            -3e9,
        ];
        // the halves and their neighbours, where rounding decides
        for k in -3..=300 {
            let half = k as f32 + 0.5;
            xs.extend([half, half.next_up(), half.next_down(), k as f32]);
        }
        // and a sweep over every exponent
        xs.extend((0..u32::MAX).step_by(65_537).map(f32::from_bits));
        for max in [15.0, 255.0] {
            for &x in &xs {
                assert_eq!(
                    code(x, max),
                    reference(x, max),
                    "{x:e} ({:#x}), max {max}",
                    x.to_bits()
                );
            }
        }
    }

    /// The quantized weight is the same whatever the number of threads,
    /// and the graph's tensors, read from a bf16 weight in place, hold the
    /// bytes of the float form's.
    #[test]
    fn quantized_weights_do_not_depend_on_threads_or_the_source() {
        // more groups than a task takes, and not a whole number of tasks
        let (n, k) = (77, 1024);
        let w = Tensor::from_f32(DType::BF16, &[n, k], &heavy_tailed(5, n * k)).unwrap();
        let values = w.to_f32_vec();
        let on = |threads: usize, format: QuantFormat| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let q = quantize_weight(&values, n, k, format, Fit::Refine, DType::BF16).unwrap();
                let t =
                    quantize_tensors(Values::Tensor(&w), n, k, format, Fit::Refine, DType::BF16)
                        .unwrap();
                (q, t)
            })
        };
        for format in [QuantFormat::int4(32), QuantFormat::int8(64)] {
            let (q, [packed, scales, zeros]) = on(1, format);
            for threads in [2, 3] {
                let (other, t) = on(threads, format);
                assert_eq!(other, q, "{format:?}, {threads} threads");
                assert_eq!(
                    t[0].bytes(),
                    packed.bytes(),
                    "{format:?}, {threads} threads"
                );
            }
            let groups = k / format.group_size;
            let words = etmetal_core::quant::as_words(
                &Tensor::from_slice(DType::U8, &[n, k / format.per_byte()], &q.packed).unwrap(),
            )
            .unwrap();
            assert_eq!(
                (packed.dtype(), packed.shape()),
                (words.dtype(), words.shape())
            );
            assert_eq!(packed.bytes(), words.bytes());
            for (t, v) in [(scales, &q.scales), (zeros, &q.zeros)] {
                let expected = Tensor::from_f32(DType::BF16, &[n, groups], v).unwrap();
                assert_eq!(t.shape(), expected.shape());
                assert_eq!(t.bytes(), expected.bytes());
            }
        }
    }

    #[test]
    fn refinement_lowers_the_error() {
        let (n, k) = (64, 1024);
        for w in [gaussian(7, n * k), heavy_tailed(7, n * k)] {
            let error = |fit| {
                let q = quantize_weight(&w, n, k, QuantFormat::int4(32), fit, DType::F32).unwrap();
                rel_error(&w, &q, k)
            };
            let (plain, refined) = (error(Fit::MinMax), error(Fit::Refine));
            assert!(
                refined < plain * 0.9,
                "refined {refined} vs min-max {plain}"
            );
            assert!(plain < 2e-2, "{plain}");
        }
    }

    /// int8 is about 2^8 times more exact than int4 in squared error
    /// (16x finer steps); per output channel (one group of all of K)
    /// costs heavy tails more than groups of 32 do.
    #[test]
    fn int8_round_trips_within_its_step() {
        let (n, k) = (32, 512);
        for w in [gaussian(3, n * k), heavy_tailed(3, n * k)] {
            let int4 =
                quantize_weight(&w, n, k, QuantFormat::int4(32), Fit::Refine, DType::F32).unwrap();
            let g32 =
                quantize_weight(&w, n, k, QuantFormat::int8(32), Fit::Refine, DType::F32).unwrap();
            let row =
                quantize_weight(&w, n, k, QuantFormat::int8(k), Fit::Refine, DType::F32).unwrap();
            assert_eq!(row.scales.len(), n);
            assert_eq!(g32.packed.len(), n * k);
            let (e4, e8, er) = (
                rel_error(&w, &int4, k),
                rel_error(&w, &g32, k),
                rel_error(&w, &row, k),
            );
            assert!(e8 < e4 / 150.0, "int8 {e8} vs int4 {e4}");
            assert!(
                e8 < er && er < e4 / 10.0,
                "group {e8}, channel {er}, int4 {e4}"
            );
            // every value within half a step of its group's grid (+ rounding)
            let r = dequantize_weight(&row, k);
            for (i, (a, b)) in w.iter().zip(&r).enumerate() {
                let step = row.scales[i / k];
                assert!(
                    (a - b).abs() <= 0.5 * step * 1.001,
                    "{i}: {a} vs {b}, step {step}"
                );
            }
        }
    }

    #[test]
    fn codes_are_rounded_to_the_stored_parameters() {
        // bf16 scales and zeros move the grid a little from the f32 fit:
        // each value's code is the nearest on the grid the kernels read.
        let (n, k) = (64, 256);
        let w = heavy_tailed(11, n * k);
        for format in [QuantFormat::int4(32), QuantFormat::int8(64)] {
            let q = quantize_weight(&w, n, k, format, Fit::Refine, DType::BF16).unwrap();
            let gs = format.group_size;
            for (i, (&v, &c)) in w.iter().zip(&unpack(format.bits, &q.packed)).enumerate() {
                let (s, z) = (q.scales[i / gs], q.zeros[i / gs]);
                assert_eq!(stored(DType::BF16, &[s]).unwrap(), [s]);
                let d = (c as f32 * s + z - v).abs();
                let nearest = (0..=format.max_code())
                    .map(|c| (c as f32 * s + z - v).abs())
                    .fold(f32::INFINITY, f32::min);
                assert!(
                    d <= nearest,
                    "{format:?} value {i}: code {c} is {d} away, the nearest {nearest}"
                );
            }
        }
    }

    #[test]
    fn codes_and_parameters_reconstruct_the_group() {
        for fit in [Fit::MinMax, Fit::Refine] {
            // A group on the 16-level grid is exact.
            let w: Vec<f32> = (0..32).map(|i| -1.0 + (i % 16) as f32 * 0.25).collect();
            let q = quantize_weight(&w, 1, 32, QuantFormat::int4(32), fit, DType::BF16).unwrap();
            assert_eq!(dequantize_weight(&q, 32), w, "{fit:?}");
            assert_eq!((q.scales[0], q.zeros[0]), (0.25, -1.0), "{fit:?}");
            // and on the 256-level grid, in int8
            let w: Vec<f32> = (0..64)
                .map(|i| -2.0 + if i == 63 { 255.0 } else { (i * 4) as f32 } / 64.0)
                .collect();
            let q = quantize_weight(&w, 1, 64, QuantFormat::int8(64), fit, DType::BF16).unwrap();
            assert_eq!(dequantize_weight(&q, 64), w, "{fit:?}");
            // A constant group keeps its value.
            let c = vec![0.5f32; 64];
            let q = quantize_weight(&c, 2, 32, QuantFormat::int4(32), fit, DType::F32).unwrap();
            assert!(dequantize_weight(&q, 32)
                .iter()
                .all(|v| (v - 0.5).abs() < 1e-6));
        }
    }
}
