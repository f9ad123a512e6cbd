//! Calibrated quantization with error feedback (GPTQ, Frantar et al.
//! 2022): the columns of `W [N, K]` are rounded one at a time, and each
//! column's rounding error is spread over the columns not yet rounded so
//! that the product with the calibration activations changes least:
//! `min ‖(W - Ŵ) X‖²` over the codes, with `H = X Xᵀ` (the activations'
//! second moments, [`InputStats`]).
//!
//! With `U` the upper Cholesky factor of `H⁻¹` (`Uᵀ U = H⁻¹`), column `i`
//! is rounded to `q`, and with `e = (w_i - q) / U[i, i]` the later columns
//! take `w_j -= e · U[i, j]`. Columns go in blocks of [`BLOCK`]: inside a
//! block the updates are rank-1 per row, the rest of the row is updated
//! once per block by a matrix product (GPTQ's lazy batch updates). Each
//! group's scale and zero are fitted ([`super::fit`]'s least squares) to
//! the group's values as the feedback has left them, when its first
//! column comes, then rounded to the stored dtype, so the codes are
//! chosen on the grid the kernels read. Rows are independent: they are
//! split over the cores.
//!
//! `H` is damped by 1% of its mean diagonal (GPTQ's default), more where
//! its Cholesky factorisation still fails; an input channel the
//! calibration never saw (`H[i, i] = 0`) keeps its rounding error.

use etmetal_core::quant::{pack, QuantFormat};
use etmetal_core::{DType, Error, Result};

use super::fit::{codes, fit_group, par_rows, stored, Fit, QuantWeight};

/// Columns per lazy batch update.
const BLOCK: usize = 128;
/// Rows of the triangular factorisations' blocks.
const NB: usize = 64;
/// The matrix products of work done on one thread use every core.
const RAYON: gemm::Parallelism = gemm::Parallelism::Rayon(0);

/// The second moments of the activations a linear reads, summed over the
/// calibration tokens: `h = Σ x xᵀ [K, K]` (row-major; symmetric).
#[derive(Clone, Debug, PartialEq)]
pub struct InputStats {
    pub k: usize,
    pub h: Vec<f32>,
    /// Tokens summed.
    pub count: usize,
}

impl InputStats {
    pub fn new(k: usize) -> InputStats {
        InputStats {
            k,
            h: vec![0.0; k * k],
            count: 0,
        }
    }

    /// Add the rows of `x [rows, K]`.
    pub fn add(&mut self, x: &[f32], rows: usize) {
        let k = self.k;
        // h += xᵀ x
        mm(
            &mut self.h,
            k,
            (k, k, rows),
            (x, 1, k),
            (x, k, 1),
            (1.0, 1.0),
            RAYON,
        );
        self.count += rows;
    }

    /// The mean square of each input channel, `H[i, i] / count`.
    pub fn diagonal(&self) -> Vec<f64> {
        let n = self.count.max(1) as f64;
        (0..self.k)
            .map(|i| self.h[i * self.k + i] as f64 / n)
            .collect()
    }
}

/// `dst [m, n] (row stride dst_rs) = alpha·dst + beta·a·b`, `a [m, k]` and
/// `b [k, n]` given as (data, row stride, column stride).
fn mm<T: Copy + 'static>(
    dst: &mut [T],
    dst_rs: usize,
    (m, n, k): (usize, usize, usize),
    a: (&[T], usize, usize),
    b: (&[T], usize, usize),
    (alpha, beta): (T, T),
    par: gemm::Parallelism,
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    assert!(dst.len() >= (m - 1) * dst_rs + n, "mm: destination");
    assert!(a.0.len() > (m - 1) * a.1 + (k - 1) * a.2, "mm: lhs");
    assert!(b.0.len() > (k - 1) * b.1 + (n - 1) * b.2, "mm: rhs");
    // SAFETY: the asserts keep every access of the three strided matrices
    // inside their slices; dst does not overlap a or b (a &mut borrow).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            true,
            a.0.as_ptr(),
            a.2 as isize,
            a.1 as isize,
            b.0.as_ptr(),
            b.2 as isize,
            b.1 as isize,
            alpha,
            beta,
            false,
            false,
            false,
            par,
        );
    }
}

/// `a [k, k]` (row-major, symmetric) factored in place into its lower
/// Cholesky factor `L` (`a = L Lᵀ`; the upper triangle is zeroed), by
/// blocks of [`NB`] with the trailing updates as matrix products. Err
/// where `a` is not positive definite.
fn cholesky(a: &mut [f64], k: usize) -> std::result::Result<(), ()> {
    for j0 in (0..k).step_by(NB) {
        let j1 = (j0 + NB).min(k);
        // the diagonal block, unblocked
        for j in j0..j1 {
            let mut d = a[j * k + j];
            for p in j0..j {
                d -= a[j * k + p] * a[j * k + p];
            }
            if d.is_nan() || d <= 0.0 {
                return Err(());
            }
            let d = d.sqrt();
            a[j * k + j] = d;
            for i in j + 1..j1 {
                let mut v = a[i * k + j];
                for p in j0..j {
                    v -= a[i * k + p] * a[j * k + p];
                }
                a[i * k + j] = v / d;
            }
        }
        if j1 == k {
            break;
        }
        // the panel below: L21 = A21 L11⁻ᵀ, row by row
        let (top, rest) = a.split_at_mut(j1 * k);
        for row in rest.chunks_exact_mut(k) {
            for j in j0..j1 {
                let mut v = row[j];
                for p in j0..j {
                    v -= row[p] * top[j * k + p];
                }
                row[j] = v / top[j * k + j];
            }
        }
        // the trailing matrix: A22 -= L21 L21ᵀ
        let m = k - j1;
        let panel: Vec<f64> = rest
            .chunks_exact(k)
            .flat_map(|r| r[j0..j1].iter().copied())
            .collect();
        let w = j1 - j0;
        mm(
            &mut rest[j1..],
            k,
            (m, m, w),
            (&panel, w, 1),
            (&panel, 1, w),
            (1.0, -1.0),
            RAYON,
        );
    }
    for i in 0..k {
        a[i * k + i + 1..(i + 1) * k].fill(0.0);
    }
    Ok(())
}

/// The inverse of the lower triangular `l [k, k]` (lower triangular too),
/// by blocks of rows: `M_i = L_ii⁻¹ (I_i - L[i, :i] M[:i])`.
fn invert_lower(l: &[f64], k: usize) -> Vec<f64> {
    let mut m = vec![0.0f64; k * k];
    for i0 in (0..k).step_by(NB) {
        let i1 = (i0 + NB).min(k);
        let rows = i1 - i0;
        // b = I_i - L[i0..i1, 0..i0] M[0..i0, 0..i0]  (columns 0..i1)
        let mut b = vec![0.0f64; rows * i1];
        for r in 0..rows {
            b[r * i1 + i0 + r] = 1.0;
        }
        if i0 > 0 {
            mm(
                &mut b,
                i1,
                (rows, i0, i0),
                (&l[i0 * k..], k, 1),
                (&m, k, 1),
                (1.0, -1.0),
                RAYON,
            );
        }
        // forward substitution with L_ii, column by column of b
        for r in 0..rows {
            let i = i0 + r;
            for c in 0..=i {
                let mut v = b[r * i1 + c];
                for p in 0..r {
                    v -= l[i * k + i0 + p] * m[(i0 + p) * k + c];
                }
                m[i * k + c] = v / l[i * k + i];
            }
        }
    }
    m
}

/// `U` (upper, `[k, k]`, f32) with `Uᵀ U = (H + λ I)⁻¹`, `λ` 1% of H's
/// mean diagonal (times 10 per failed factorisation). With `J` the
/// reversal, `J H J = L Lᵀ` gives `H = R Rᵀ` for the upper `R = J L J`,
/// so `H⁻¹ = (R⁻¹)ᵀ R⁻¹` and `U = R⁻¹ = J L⁻¹ J`.
fn inverse_factor(stats: &InputStats) -> Result<Vec<f32>> {
    let k = stats.k;
    let diag = stats.diagonal();
    let mean = diag.iter().sum::<f64>() / k.max(1) as f64;
    let n = stats.count.max(1) as f64;
    let mut damp = 0.01 * mean.max(1e-12);
    for _ in 0..4 {
        // J H J, normalised by the count, damped; a channel never seen
        // gets a diagonal of 1 (its column's error then feeds nothing)
        let mut a = vec![0.0f64; k * k];
        for i in 0..k {
            for j in 0..k {
                a[(k - 1 - i) * k + (k - 1 - j)] = stats.h[i * k + j] as f64 / n;
            }
            let d = &mut a[(k - 1 - i) * k + (k - 1 - i)];
            if diag[i] <= 0.0 {
                *d = 1.0;
            }
            *d += damp;
        }
        if cholesky(&mut a, k).is_ok() {
            let inv = invert_lower(&a, k);
            let mut u = vec![0.0f32; k * k];
            for i in 0..k {
                for j in i..k {
                    u[i * k + j] = inv[(k - 1 - i) * k + (k - 1 - j)] as f32;
                }
            }
            return Ok(u);
        }
        damp *= 10.0;
    }
    Err(Error::invalid_input(format!(
        "calibration statistics of {k} channels are not positive definite \
         even damped by {damp:.3e}"
    )))
}

/// Quantize `w [n, k]` in `format` with GPTQ's error feedback over the
/// activations of `stats`, scales and zeros stored in `dtype`.
pub fn gptq(
    w: &[f32],
    n: usize,
    k: usize,
    stats: &InputStats,
    format: QuantFormat,
    dtype: DType,
) -> Result<QuantWeight> {
    if stats.k != k {
        return Err(Error::internal(format!(
            "calibration statistics of {} channels for a weight of K = {k}",
            stats.k
        )));
    }
    let u = inverse_factor(stats)?;
    let gs = format.group_size;
    let max = format.max_code() as f32;
    let groups = k / gs;
    let rows = par_rows(n, |r0, count| -> Result<(Vec<u8>, Vec<f32>, Vec<f32>)> {
        let mut wr = w[r0 * k..(r0 + count) * k].to_vec();
        let mut q = vec![0u8; count * k];
        let (mut scales, mut zeros) = (vec![0f32; count * groups], vec![0f32; count * groups]);
        let mut err = vec![0f32; count * BLOCK];
        let (mut gq, mut trial) = (vec![0u8; gs], vec![0u8; gs]);
        for b0 in (0..k).step_by(BLOCK) {
            let b1 = (b0 + BLOCK).min(k);
            for i in b0..b1 {
                if i % gs == 0 {
                    // this group's parameters from the values as they are
                    // now (a group longer than a block: its columns past
                    // the block as they were before the block's update)
                    let g = i / gs;
                    let (mut s, mut z) = (Vec::with_capacity(count), Vec::with_capacity(count));
                    for r in 0..count {
                        let vals = &wr[r * k + i..r * k + i + gs];
                        let (a, b) = fit_group(vals, max, Fit::Refine, &mut gq, &mut trial);
                        s.push(a);
                        z.push(b);
                    }
                    let (s, z) = (stored(dtype, &s)?, stored(dtype, &z)?);
                    for r in 0..count {
                        scales[r * groups + g] = s[r];
                        zeros[r * groups + g] = z[r];
                    }
                }
                let (urow, d) = (&u[i * k..(i + 1) * k], u[i * k + i]);
                for r in 0..count {
                    let g = r * groups + i / gs;
                    let row = &mut wr[r * k..(r + 1) * k];
                    let mut c = [0u8];
                    codes(&row[i..=i], scales[g], zeros[g], max, &mut c);
                    q[r * k + i] = c[0];
                    let e = (row[i] - (c[0] as f32 * scales[g] + zeros[g])) / d;
                    err[r * BLOCK + i - b0] = e;
                    for (v, h) in row[i + 1..b1].iter_mut().zip(&urow[i + 1..b1]) {
                        *v -= e * h;
                    }
                }
            }
            if b1 < k {
                // the rest of each row: W[:, b1..] -= E U[b0..b1, b1..]
                mm(
                    &mut wr[b1..],
                    k,
                    (count, k - b1, b1 - b0),
                    (&err, BLOCK, 1),
                    (&u[b0 * k + b1..], k, 1),
                    (1.0, -1.0),
                    // the rows are already split over the cores
                    gemm::Parallelism::None,
                );
            }
        }
        Ok((q, scales, zeros))
    });
    let mut out = QuantWeight {
        format,
        packed: Vec::with_capacity(n * k * format.bits as usize / 8),
        scales: Vec::with_capacity(n * groups),
        zeros: Vec::with_capacity(n * groups),
    };
    for part in rows {
        let (q, s, z) = part?;
        out.packed.extend(pack(format.bits, &q));
        out.scales.extend(s);
        out.zeros.extend(z);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::fit::tests::{gaussian, heavy_tailed};
    use super::super::fit::{dequantize_weight, quantize_weight};
    use super::*;

    fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for p in 0..k {
                let av = a[i * k + p] as f64;
                for j in 0..n {
                    out[i * n + j] += av * b[p * n + j] as f64;
                }
            }
        }
        out
    }

    #[test]
    fn factorisations_invert_the_damped_matrix() {
        // H = X Xᵀ of correlated activations, K not a multiple of NB
        let (k, rows) = (150, 400);
        let base = gaussian(5, rows * k);
        let x: Vec<f32> = base
            .chunks_exact(k)
            .flat_map(|r| {
                let r = r.to_vec();
                (0..k).map(move |i| r[i] + 0.5 * r[(i + 1) % k])
            })
            .collect();
        let mut stats = InputStats::new(k);
        stats.add(&x[..200 * k], 200);
        stats.add(&x[200 * k..], 200);
        assert_eq!(stats.count, 400);
        let u = inverse_factor(&stats).unwrap();
        // Uᵀ U (H/count + λI) = I
        let mut ut = vec![0f32; k * k];
        for i in 0..k {
            for j in 0..k {
                ut[j * k + i] = u[i * k + j];
                if j < i {
                    assert_eq!(u[i * k + j], 0.0);
                }
            }
        }
        let inv = matmul(&ut, &u, k, k, k);
        let mean = stats.diagonal().iter().sum::<f64>() / k as f64;
        let h: Vec<f32> = (0..k * k)
            .map(|i| {
                let v =
                    stats.h[i] as f64 / 400.0 + if i % (k + 1) == 0 { 0.01 * mean } else { 0.0 };
                v as f32
            })
            .collect();
        let inv32: Vec<f32> = inv.iter().map(|&v| v as f32).collect();
        let id = matmul(&inv32, &h, k, k, k);
        for i in 0..k {
            for j in 0..k {
                let want = if i == j { 1.0 } else { 0.0 };
                assert!(
                    (id[i * k + j] - want).abs() < 1e-3,
                    "({i}, {j}): {}",
                    id[i * k + j]
                );
            }
        }
    }

    /// On activations with a few loud, correlated channels, error feedback
    /// lowers the output error `‖(W - Ŵ) X‖²` well below rounding to
    /// nearest, for int4 and int8, while every code stays on its group's
    /// stored grid.
    #[test]
    fn error_feedback_lowers_the_output_error() {
        let (n, k, rows) = (48, 256, 512);
        let w = heavy_tailed(21, n * k);
        let z = gaussian(22, rows * k);
        let x: Vec<f32> = z
            .chunks_exact(k)
            .flat_map(|r| {
                let r = r.to_vec();
                (0..k).map(move |i| {
                    let loud = if i % 37 == 0 { 8.0 } else { 1.0 };
                    loud * (r[i] + 0.7 * r[(i * 7 + 3) % k])
                })
            })
            .collect();
        let mut stats = InputStats::new(k);
        stats.add(&x, rows);
        // ‖(W - Ŵ) X‖² with X [k, rows] = xᵀ
        let out_err = |q: &QuantWeight| {
            let d: Vec<f32> = w
                .iter()
                .zip(dequantize_weight(q, k))
                .map(|(a, b)| a - b)
                .collect();
            let mut xt = vec![0f32; k * rows];
            for r in 0..rows {
                for i in 0..k {
                    xt[i * rows + r] = x[r * k + i];
                }
            }
            matmul(&d, &xt, n, k, rows)
                .iter()
                .map(|v| v * v)
                .sum::<f64>()
        };
        for format in [QuantFormat::int4(32), QuantFormat::int8(k)] {
            let rtn = quantize_weight(&w, n, k, format, Fit::Refine, DType::BF16).unwrap();
            let fb = gptq(&w, n, k, &stats, format, DType::BF16).unwrap();
            let (a, b) = (out_err(&rtn), out_err(&fb));
            assert!(
                b < 0.75 * a,
                "{format:?}: gptq {b:.4e} vs round to nearest {a:.4e}"
            );
            for (g, (s, z)) in fb.scales.iter().zip(&fb.zeros).enumerate() {
                assert_eq!(
                    stored(DType::BF16, &[*s, *z]).unwrap(),
                    [*s, *z],
                    "group {g}"
                );
            }
        }
        let e = gptq(&w, n, 128, &stats, QuantFormat::int4(32), DType::F32).unwrap_err();
        assert!(e.to_string().contains("256 channels"), "{e}");
    }
}
