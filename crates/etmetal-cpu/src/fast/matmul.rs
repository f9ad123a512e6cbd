//! f32 matrix products written into the output: `mm` and `bmm` through
//! the gemm crate, or a streaming GEMV when the left operand is one row (a
//! decoder step, where reading the weight is all the work), and `addmm`
//! with its bias as the product's starting value.

use gemm::Parallelism;
use rayon::prelude::*;

use crate::matmul::{Mat, MatElem};
use crate::simd;
use crate::view::{View, ViewMut};

/// One-row products with a right operand of at least this many elements
/// take the GEMV; smaller ones are not worth its partial sums.
const GEMV_MIN: usize = 1 << 15;
/// Rows of the right operand per GEMV task, at least.
const GEMV_ROWS: usize = 64;

pub fn matmul(inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let [Some(a), Some(b)] = inputs else {
        return false;
    };
    let shape = out.shape;
    let (Some(x), Some(w), Some(dst)) = (a.f32s(), b.f32s(), out.f32s()) else {
        return false;
    };
    match (a.shape, b.shape, shape) {
        (&[m, k], &[k2, n], &[m2, n2]) if k == k2 && m == m2 && n == n2 => {
            product(dst, x, w, (m, k, n), false, Parallelism::Rayon(0));
        }
        (&[bs, m, k], &[bs2, k2, n], &[bs3, m2, n2])
            if bs == bs2 && bs == bs3 && k == k2 && m == m2 && n == n2 =>
        {
            if m * n == 0 {
                return true;
            }
            dst.par_chunks_mut(m * n).enumerate().for_each(|(i, d)| {
                let (xi, wi) = (
                    &x[i * m * k..(i + 1) * m * k],
                    &w[i * k * n..(i + 1) * k * n],
                );
                product(d, xi, wi, (m, k, n), false, Parallelism::None)
            });
        }
        _ => return false,
    }
    true
}

/// `beta · bias + alpha · (a @ b)` for a bias of `[n]`, `[1, n]` or
/// `[m, n]` and `alpha` 1 (the only one exporters write).
pub fn addmm(beta: f64, alpha: f64, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let [Some(bias), Some(a), Some(b)] = inputs else {
        return false;
    };
    let shape = out.shape;
    let (Some(c), Some(x), Some(w), Some(dst)) = (bias.f32s(), a.f32s(), b.f32s(), out.f32s())
    else {
        return false;
    };
    let (&[m, k], &[k2, n], &[m2, n2]) = (a.shape, b.shape, shape) else {
        return false;
    };
    let row = matches!(bias.shape, [bn] | [1, bn] if *bn == n);
    if alpha != 1.0 || k != k2 || m != m2 || n != n2 || !(row || bias.shape == shape) {
        return false;
    }
    // PyTorch ignores the bias entirely (NaN included) when beta is 0
    if beta != 0.0 {
        let beta = beta as f32;
        for (i, d) in dst.chunks_exact_mut(n.max(1)).enumerate() {
            let src = if row { c } else { &c[i * n..(i + 1) * n] };
            d.iter_mut().zip(src).for_each(|(o, &v)| *o = beta * v);
        }
    }
    product(dst, x, w, (m, k, n), beta != 0.0, Parallelism::Rayon(0));
    true
}

/// `dst (+)= a[m×k] @ b[k×n]`, both contiguous.
fn product(
    dst: &mut [f32],
    a: &[f32],
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    acc: bool,
    par: Parallelism,
) {
    if m == 1 && k * n >= GEMV_MIN && matches!(par, Parallelism::Rayon(_)) {
        return gemv(dst, a, b, k, n, acc);
    }
    let mat = |data, rs| Mat { data, rs, cs: 1 };
    f32::gemm(dst, m, n, k, mat(a, k), mat(b, n), acc, par);
}

/// `y[n] (+)= x[k] @ b[k×n]`, reading `b` once in order: each task sums
/// the rows of one range of `k` into its own partial result, which are
/// added up at the end (the partials are small next to `b`).
fn gemv(y: &mut [f32], x: &[f32], b: &[f32], k: usize, n: usize, acc: bool) {
    let tasks = rayon::current_num_threads().min(k / GEMV_ROWS).max(1);
    let rows = k.div_ceil(tasks);
    let partials: Vec<Vec<f32>> = (0..tasks)
        .into_par_iter()
        .map(|t| {
            let (p0, p1) = (t * rows, ((t + 1) * rows).min(k));
            let mut part = vec![0f32; n];
            simd::dispatch(
                #[inline(always)]
                || rows_axpy(&mut part, &x[p0..p1], &b[p0 * n..p1 * n]),
            );
            part
        })
        .collect();
    if !acc {
        y.fill(0.0);
    }
    for part in &partials {
        y.iter_mut().zip(part).for_each(|(o, &v)| *o += v);
    }
}

/// `y += Σ_p x[p] · rows[p]`, four rows at a time so that `y` is read and
/// written once per four rows of `rows`.
#[inline(always)]
fn rows_axpy(y: &mut [f32], x: &[f32], rows: &[f32]) {
    let n = y.len();
    if n == 0 {
        return;
    }
    let mut quads = rows.chunks_exact(4 * n);
    let mut xs = x.chunks_exact(4);
    for (q, c) in (&mut quads).zip(&mut xs) {
        let (r0, rest) = q.split_at(n);
        let (r1, rest) = rest.split_at(n);
        let (r2, r3) = rest.split_at(n);
        for j in 0..n {
            y[j] += c[0] * r0[j] + c[1] * r1[j] + c[2] * r2[j] + c[3] * r3[j];
        }
    }
    for (r, &c) in quads.remainder().chunks_exact(n).zip(xs.remainder()) {
        y.iter_mut().zip(r).for_each(|(o, &v)| *o += c * v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::naive_mm;

    fn ramp(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + seed) % 23) as f32 / 8.0 - 1.4)
            .collect()
    }

    fn view<'a>(shape: &'a [usize], v: &'a [f32]) -> View<'a> {
        View {
            dtype: etmetal_core::DType::F32,
            shape,
            bytes: bytemuck::cast_slice(v),
        }
    }

    fn view_mut<'a>(shape: &'a [usize], v: &'a mut [f32]) -> ViewMut<'a> {
        ViewMut {
            dtype: etmetal_core::DType::F32,
            shape,
            bytes: bytemuck::cast_slice_mut(v),
        }
    }

    fn close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{i}: {g} vs {w}");
        }
    }

    #[test]
    fn gemv_and_gemm_match_the_reference() {
        // one-row products big enough for the GEMV, with row counts that
        // leave remainders of the four-row blocks and of the tasks
        for (m, k, n) in [(1, 1027, 61), (1, 203, 777), (3, 130, 300), (1, 5, 3)] {
            let (a, b) = (ramp(m * k, 1), ramp(k * n, 5));
            let mut y = vec![f32::NAN; m * n];
            let (sa, sb, so) = ([m, k], [k, n], [m, n]);
            let mut out = view_mut(&so, &mut y);
            assert!(matmul(
                &[Some(view(&sa, &a)), Some(view(&sb, &b))],
                &mut out
            ));
            close(&y, &naive_mm(&a, &b, m, k, n));
        }
    }

    #[test]
    fn batched_and_addmm() {
        let (bs, m, k, n) = (3, 2, 5, 4);
        let (a, b) = (ramp(bs * m * k, 2), ramp(bs * k * n, 3));
        let mut y = vec![0f32; bs * m * n];
        let (sa, sb, so) = ([bs, m, k], [bs, k, n], [bs, m, n]);
        let mut out = view_mut(&so, &mut y);
        assert!(matmul(
            &[Some(view(&sa, &a)), Some(view(&sb, &b))],
            &mut out
        ));
        for i in 0..bs {
            let want = naive_mm(&a[i * m * k..], &b[i * k * n..], m, k, n);
            close(&y[i * m * n..(i + 1) * m * n], &want);
        }
        // addmm with a row bias and with a full one; beta 0 ignores NaN
        let (a, b) = (ramp(m * k, 4), ramp(k * n, 6));
        let prod = naive_mm(&a, &b, m, k, n);
        for (bias, shape, beta) in [
            (ramp(n, 9), vec![n], 0.5),
            (ramp(m * n, 8), vec![m, n], 1.0),
            (vec![f32::NAN; n], vec![1, n], 0.0),
        ] {
            let mut y = vec![0f32; m * n];
            let (sa, sb, so) = ([m, k], [k, n], [m, n]);
            let mut out = view_mut(&so, &mut y);
            let ins = [
                Some(view(&shape, &bias)),
                Some(view(&sa, &a)),
                Some(view(&sb, &b)),
            ];
            assert!(addmm(beta, 1.0, &ins, &mut out));
            let want: Vec<f32> = (0..m * n)
                .map(|i| {
                    let c = if shape.len() == 2 && shape[0] == m {
                        bias[i]
                    } else {
                        bias[i % n]
                    };
                    if beta == 0.0 {
                        prod[i]
                    } else {
                        beta as f32 * c + prod[i]
                    }
                })
                .collect();
            close(&y, &want);
        }
    }
}
