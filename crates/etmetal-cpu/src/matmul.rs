//! Matrix products: `torch.matmul` (1-D operands, batch broadcasting),
//! `addmm` and `linear`. f32/f64 go through the `gemm` crate (bf16/f16 are
//! computed in f32), integers through a plain triple loop.

use std::ops::{Add, Mul};

use etmetal_core::shape::{broadcast_shapes, broadcast_strides};
use etmetal_core::{Result, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::buf::{domain, numeric, Elem};
use crate::ctx::Ctx;
use crate::strided::for_each_offset;

/// A row-major-or-strided matrix operand: data and (row, column) strides.
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

/// Element types with a matrix product.
pub trait MatElem: Elem + Default + Add<Output = Self> + Mul<Output = Self> + 'static {
    fn from_f64(v: f64) -> Self;
    /// `dst[m×n]` (contiguous) `= a[m×k] @ b[k×n]`, or `+=` with `acc`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        dst: &mut [Self],
        m: usize,
        n: usize,
        k: usize,
        a: Mat<Self>,
        b: Mat<Self>,
        acc: bool,
        par: Parallelism,
    );
    /// `dst[m×n]` (contiguous, overwritten) `= a[m×k] @ b[k×n]`.
    fn mm(
        dst: &mut [Self],
        m: usize,
        n: usize,
        k: usize,
        a: Mat<Self>,
        b: Mat<Self>,
        par: Parallelism,
    ) {
        Self::gemm(dst, m, n, k, a, b, false, par)
    }
}

macro_rules! impl_gemm {
    ($t:ty) => {
        impl MatElem for $t {
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn gemm(
                dst: &mut [Self],
                m: usize,
                n: usize,
                k: usize,
                a: Mat<Self>,
                b: Mat<Self>,
                acc: bool,
                par: Parallelism,
            ) {
                if m == 0 || n == 0 {
                    return;
                }
                if k == 0 {
                    if !acc {
                        dst.fill(0.0);
                    }
                    return;
                }
                assert!(dst.len() >= m * n, "gemm destination too small");
                assert!(
                    a.data.len() > (m - 1) * a.rs + (k - 1) * a.cs,
                    "gemm lhs too small"
                );
                assert!(
                    b.data.len() > (k - 1) * b.rs + (n - 1) * b.cs,
                    "gemm rhs too small"
                );
                // SAFETY: the asserts above keep every access of the three
                // strided matrices inside their slices.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        dst.as_mut_ptr(),
                        1,
                        n as isize,
                        acc,
                        a.data.as_ptr(),
                        a.cs as isize,
                        a.rs as isize,
                        b.data.as_ptr(),
                        b.cs as isize,
                        b.rs as isize,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        par,
                    );
                }
            }
        }
    };
}
impl_gemm!(f32);
impl_gemm!(f64);

impl MatElem for i64 {
    fn from_f64(v: f64) -> Self {
        v as i64
    }
    fn gemm(
        dst: &mut [Self],
        m: usize,
        n: usize,
        k: usize,
        a: Mat<Self>,
        b: Mat<Self>,
        acc: bool,
        _: Parallelism,
    ) {
        for i in 0..m {
            for j in 0..n {
                let start = if acc { dst[i * n + j] } else { 0 };
                dst[i * n + j] = (0..k).fold(start, |s, p| {
                    s.wrapping_add(
                        a.data[i * a.rs + p * a.cs].wrapping_mul(b.data[p * b.rs + j * b.cs]),
                    )
                });
            }
        }
    }
}

/// Run `$body` with `$T` the element type matrix products of output dtype
/// `out` compute in.
macro_rules! mat_elem {
    ($ctx:expr, $T:ident => $body:expr) => {
        numeric!(domain($ctx.out_dtype(0)?), $T => $body, bool => return Err($ctx.unsupported("matrix products of bool are not supported")))
    };
}

/// Batched `[.., m, k] @ [.., k, n]` with broadcast batch dims.
fn batched<T: MatElem>(
    a: &[T],
    ab: &[usize],
    b: &[T],
    bb: &[usize],
    batch: &[usize],
    (m, k, n): (usize, usize, usize),
) -> Vec<T> {
    let (sa, sb) = (broadcast_strides(ab, batch), broadcast_strides(bb, batch));
    let mut pairs = Vec::new();
    for_each_offset(batch, [&sa, &sb], [0, 0], |[i, j]| {
        pairs.push((i * m * k, j * k * n))
    });
    let mut out = vec![T::default(); pairs.len() * m * n];
    if m * n == 0 {
        return out;
    }
    let mm = |dst: &mut [T], (ia, ib): (usize, usize), par| {
        T::mm(
            dst,
            m,
            n,
            k,
            Mat {
                data: &a[ia..],
                rs: k,
                cs: 1,
            },
            Mat {
                data: &b[ib..],
                rs: n,
                cs: 1,
            },
            par,
        )
    };
    if pairs.len() == 1 {
        mm(&mut out, pairs[0], Parallelism::Rayon(0));
    } else {
        out.par_chunks_mut(m * n)
            .zip(pairs)
            .for_each(|(dst, p)| mm(dst, p, Parallelism::None));
    }
    out
}

pub fn matmul(ctx: &Ctx) -> Result<Tensor> {
    let (a, b) = (ctx.input(0)?, ctx.input(1)?);
    if a.rank() == 0 || b.rank() == 0 {
        return Err(ctx.invalid(format!(
            "both operands need at least 1 dim, got {:?} and {:?}",
            a.shape(),
            b.shape()
        )));
    }
    // 1-D operands become a row (left) or a column (right), removed afterwards
    let ash: Vec<usize> = if a.rank() == 1 {
        vec![1, a.shape()[0]]
    } else {
        a.shape().to_vec()
    };
    let bsh: Vec<usize> = if b.rank() == 1 {
        vec![b.shape()[0], 1]
    } else {
        b.shape().to_vec()
    };
    let (m, k) = (ash[ash.len() - 2], ash[ash.len() - 1]);
    let (k2, n) = (bsh[bsh.len() - 2], bsh[bsh.len() - 1]);
    if k != k2 {
        return Err(ctx.invalid(format!(
            "shapes {:?} and {:?} cannot be multiplied ({k} != {k2})",
            a.shape(),
            b.shape()
        )));
    }
    let (ab, bb) = (&ash[..ash.len() - 2], &bsh[..bsh.len() - 2]);
    let batch = broadcast_shapes(ab, bb).map_err(|e| ctx.invalid(e.message()))?;
    let mut oshape = batch.clone();
    if a.rank() > 1 {
        oshape.push(m);
    }
    if b.rank() > 1 {
        oshape.push(n);
    }
    let buf = mat_elem!(ctx, T => Elem::wrap(batched(&T::load(a), ab, &T::load(b), bb, &batch, (m, k, n))));
    buf.store(ctx.out_dtype(0)?, &oshape)
}

fn addmm_in<T: MatElem>(
    bias: &[T],
    bias_shape: &[usize],
    a: &[T],
    b: &[T],
    (m, k, n): (usize, usize, usize),
    beta: f64,
    alpha: f64,
) -> Vec<T> {
    let mut prod = batched(a, &[], b, &[], &[], (m, k, n));
    let sbias = broadcast_strides(bias_shape, &[m, n]);
    let (beta_t, alpha_t) = (T::from_f64(beta), T::from_f64(alpha));
    let mut j = 0;
    for_each_offset(&[m, n], [&sbias], [0], |[i]| {
        let p = if alpha == 1.0 {
            prod[j]
        } else {
            alpha_t * prod[j]
        };
        // PyTorch ignores the bias entirely (NaN included) when beta is 0
        prod[j] = match beta {
            0.0 => p,
            1.0 => bias[i] + p,
            _ => beta_t * bias[i] + p,
        };
        j += 1;
    });
    prod
}

pub fn addmm(ctx: &Ctx, beta: f64, alpha: f64) -> Result<Tensor> {
    let (bias, a, b) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    if a.rank() != 2 || b.rank() != 2 || a.shape()[1] != b.shape()[0] {
        return Err(ctx.invalid(format!(
            "needs [m, k] @ [k, n], got {:?} and {:?}",
            a.shape(),
            b.shape()
        )));
    }
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    if broadcast_shapes(bias.shape(), &[m, n]).ok().as_deref() != Some(&[m, n][..]) {
        return Err(ctx.invalid(format!(
            "bias of shape {:?} does not broadcast to [{m}, {n}]",
            bias.shape()
        )));
    }
    let buf = mat_elem!(ctx, T => Elem::wrap(addmm_in(&T::load(bias), bias.shape(), &T::load(a), &T::load(b), (m, k, n), beta, alpha)));
    buf.store(ctx.out_dtype(0)?, &[m, n])
}

fn linear_in<T: MatElem>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    rows: usize,
    inf: usize,
    outf: usize,
) -> Vec<T> {
    let mut out = vec![T::default(); rows * outf];
    // weight is [out, in]; read as its transpose [in, out]
    T::mm(
        &mut out,
        rows,
        outf,
        inf,
        Mat {
            data: x,
            rs: inf,
            cs: 1,
        },
        Mat {
            data: w,
            rs: 1,
            cs: inf,
        },
        Parallelism::Rayon(0),
    );
    if let Some(bias) = bias {
        for row in out.chunks_exact_mut(outf.max(1)) {
            row.iter_mut().zip(bias).for_each(|(o, &b)| *o = *o + b);
        }
    }
    out
}

pub fn linear(ctx: &Ctx) -> Result<Tensor> {
    let (x, w) = (ctx.input(0)?, ctx.input(1)?);
    let bias = ctx.optional(2);
    if w.rank() != 2 || x.rank() == 0 || x.shape()[x.rank() - 1] != w.shape()[1] {
        return Err(ctx.invalid(format!(
            "input {:?} does not match weight {:?} ([out, in])",
            x.shape(),
            w.shape()
        )));
    }
    let (outf, inf) = (w.shape()[0], w.shape()[1]);
    if let Some(b) = bias {
        if b.numel() != outf {
            return Err(ctx.invalid(format!(
                "bias of shape {:?} does not match {outf} output features",
                b.shape()
            )));
        }
    }
    let rows = x.shape()[..x.rank() - 1].iter().product();
    let mut oshape = x.shape().to_vec();
    *oshape.last_mut().expect("rank checked above") = outf;
    let buf = mat_elem!(ctx, T => {
        let b = bias.map(T::load);
        Elem::wrap(linear_in(&T::load(x), &T::load(w), b.as_deref(), rows, inf, outf))
    });
    buf.store(ctx.out_dtype(0)?, &oshape)
}

#[cfg(test)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{DType, Op, Tensor};

    #[test]
    fn matmul_shapes_follow_torch_matmul() {
        let a = f32t(&[2, 1, 3, 5], &ramp(30, 11, 7));
        let b = f32t(&[4, 5, 2], &ramp(40, 13, 5));
        let y = run1(Op::MatMul, &[&a, &b], DType::F32, &[2, 4, 3, 2])
            .unwrap()
            .to_f32_vec();
        let (av, bv) = (a.to_f32_vec(), b.to_f32_vec());
        for i in 0..2 {
            for j in 0..4 {
                let want = naive_mm(
                    &av[i * 15..(i + 1) * 15],
                    &bv[j * 10..(j + 1) * 10],
                    3,
                    5,
                    2,
                );
                close(&y[(i * 4 + j) * 6..(i * 4 + j + 1) * 6], &want, 1e-6);
            }
        }
        let v = f32t(&[5], &[1.0, 0.0, 0.0, 0.0, 1.0]);
        let y = run1(Op::MatMul, &[&v, &b], DType::F32, &[4, 2])
            .unwrap()
            .to_f32_vec();
        assert_eq!(&y[..2], &[bv[0] + bv[8], bv[1] + bv[9]]);
        let y = run1(Op::MatMul, &[&v, &v], DType::F32, &[]).unwrap();
        assert_eq!(y.to_f32_vec(), vec![2.0]);
        let e = run1(Op::MatMul, &[&a, &a], DType::F32, &[2, 1, 3, 3]).unwrap_err();
        assert!(e.to_string().contains("cannot be multiplied"), "{e}");
    }

    #[test]
    fn integer_and_bf16_products() {
        let a = i64t(&[2, 2], &[1 << 40, 1, 2, 3]);
        let y = run1(Op::MatMul, &[&a, &i64t(&[2], &[2, 5])], DType::I64, &[2]).unwrap();
        assert_eq!(y.to_i64_vec(), vec![(1 << 41) + 5, 19]);
        let x = Tensor::from_f32(DType::BF16, &[1, 2], &[1.0, 1.0]).unwrap();
        let w = Tensor::from_f32(DType::BF16, &[2, 1], &[1.0, 1.0 / 256.0]).unwrap();
        // 1 + 2^-8 rounds to 1.0 in bf16
        assert_eq!(
            run1(Op::MatMul, &[&x, &w], DType::BF16, &[1, 1])
                .unwrap()
                .to_f32_vec(),
            vec![1.0]
        );
    }

    #[test]
    fn addmm_and_linear() {
        let a = f32t(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let b = f32t(&[3, 2], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        let bias = f32t(&[2], &[10.0, 20.0]);
        let y = run1(
            Op::Addmm {
                beta: 0.5,
                alpha: 2.0,
            },
            &[&bias, &a, &b],
            DType::F32,
            &[2, 2],
        )
        .unwrap();
        assert_eq!(y.to_f32_vec(), vec![13.0, 20.0, 25.0, 32.0]);
        let nan = f32t(&[1], &[f32::NAN]);
        let y = run1(
            Op::Addmm {
                beta: 0.0,
                alpha: 1.0,
            },
            &[&nan, &a, &b],
            DType::F32,
            &[2, 2],
        )
        .unwrap();
        assert_eq!(y.to_f32_vec(), vec![4.0, 5.0, 10.0, 11.0]);
        // linear: x [1, 2, 3] @ w[2, 3].T + bias
        let x = f32t(&[1, 2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let w = f32t(&[2, 3], &[1.0, 0.0, -1.0, 0.5, 0.5, 0.5]);
        let y = run1(Op::Linear, &[&x, &w, &bias], DType::F32, &[1, 2, 2]).unwrap();
        assert_eq!(y.to_f32_vec(), vec![8.0, 23.0, 8.0, 27.5]);
        let y = crate::execute(
            &Op::Linear,
            &[Some(&x), Some(&w), None],
            &[(DType::F32, vec![1, 2, 2])],
        )
        .unwrap();
        assert_eq!(y[0].to_f32_vec(), vec![-2.0, 3.0, -2.0, 7.5]);
        let e = run1(Op::Linear, &[&x, &b], DType::F32, &[1, 2, 3]).unwrap_err();
        assert!(e.to_string().contains("weight"), "{e}");
    }
}
