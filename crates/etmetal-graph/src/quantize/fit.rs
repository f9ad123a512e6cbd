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

use etmetal_core::quant::{pack, unpack, QuantFormat};
use etmetal_core::{DType, Result, Tensor};

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
/// squared error.
pub(super) fn codes(w: &[f32], scale: f32, zero: f32, max: f32, q: &mut [u8]) -> f64 {
    let inv = 1.0 / scale;
    let mut err = 0.0f64;
    for (v, c) in w.iter().zip(q.iter_mut()) {
        *c = ((v - zero) * inv).round().clamp(0.0, max) as u8;
        let d = (*c as f32 * scale + zero - v) as f64;
        err += d * d;
    }
    err
}

/// The `(scale, zero)` minimising the squared error of `w` for the codes
/// `q`; None when the codes do not determine a positive scale.
fn least_squares(w: &[f32], q: &[u8]) -> Option<(f32, f32)> {
    let n = w.len() as f64;
    let (mut sq, mut sqq, mut sw, mut sqw) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&v, &c) in w.iter().zip(q) {
        let (c, v) = (c as f64, v as f64);
        sq += c;
        sqq += c * c;
        sw += v;
        sqw += c * v;
    }
    let det = n * sqq - sq * sq;
    if det <= 0.0 {
        return None;
    }
    let scale = (n * sqw - sq * sw) / det;
    (scale > 1e-12).then(|| (scale as f32, ((sw - scale * sq) / n) as f32))
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
    let mut best_err = codes(w, best.0, best.1, max, q);
    if fit == Fit::MinMax {
        return best;
    }
    // Refinement: refit to the codes, re-round the codes, while the error
    // drops.
    trial.copy_from_slice(q);
    for _ in 0..REFINE_ROUNDS {
        let Some((scale, zero)) = least_squares(w, trial) else {
            break;
        };
        let err = codes(w, scale, zero, max, trial);
        if err >= best_err {
            break;
        }
        (best, best_err) = ((scale, zero), err);
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
    let gs = format.group_size;
    let max = format.max_code() as f32;
    let groups = n * (k / gs);
    // groups split over the cores: each is independent
    let parts = par_rows(groups, |g0, count| {
        let mut trial = vec![0u8; gs];
        let mut q = vec![0u8; gs];
        let (mut s, mut z) = (Vec::with_capacity(count), Vec::with_capacity(count));
        for g in g0..g0 + count {
            let (a, b) = fit_group(&w[g * gs..(g + 1) * gs], max, fit, &mut q, &mut trial);
            s.push(a);
            z.push(b);
        }
        (s, z)
    });
    let (mut scales, mut zeros) = (Vec::with_capacity(groups), Vec::with_capacity(groups));
    for (s, z) in parts {
        scales.extend(s);
        zeros.extend(z);
    }
    let (scales, zeros) = (stored(dtype, &scales)?, stored(dtype, &zeros)?);
    let mut q = vec![0u8; n * k];
    for (i, (wg, qg)) in w.chunks_exact(gs).zip(q.chunks_exact_mut(gs)).enumerate() {
        codes(wg, scales[i], zeros[i], max, qg);
    }
    Ok(QuantWeight {
        format,
        packed: pack(format.bits, &q),
        scales,
        zeros,
    })
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
