//! Fast paths for the cases models spend their time in: mostly f32,
//! contiguous, one output, written straight into the caller's memory by
//! [`crate::execute_into`]. Each returns `false`, having written nothing,
//! when a case is not its own (another dtype, a shape it does not take, an
//! input that does not fit); the reference kernels then run, and report
//! any error.

mod conv;
mod layout;
pub(crate) mod math;
mod matmul;
mod pointwise;
mod pool;
mod rows;

use etmetal_core::Op;
use rayon::prelude::*;

use crate::simd;
use crate::view::{View, ViewMut};

/// Below this many elements of work an op runs on the calling thread.
const PAR_MIN: usize = 1 << 15;
/// Elements of work per parallel task, about.
const BLOCK: usize = 1 << 14;

/// Run `op` on a fast path; `false` when none takes it.
pub fn run(op: &Op, inputs: &[Option<View>], outputs: &mut [ViewMut]) -> bool {
    if let Op::MaxPool(p) = op {
        return pool::max_pool(p, inputs, outputs);
    }
    let [out] = outputs else {
        return false;
    };
    match op {
        Op::Reshape { .. } | Op::Identity | Op::Cast { .. } => layout::reshape(op, inputs, out),
        Op::IndexSelect { dim } => layout::index_select(*dim, inputs, out),
        Op::Embedding => layout::embedding(inputs, out),
        Op::Permute { .. } | Op::Expand { .. } | Op::Slice { .. } | Op::Select { .. } => {
            layout::view(op, inputs, out)
        }
        Op::Cat { dim } => layout::cat(*dim, inputs, out),
        Op::Unary(u) => pointwise::unary(*u, inputs, out),
        Op::Binary(b) => pointwise::binary(*b, inputs, out),
        Op::Where => pointwise::where_(inputs, out),
        Op::MatMul => matmul::matmul(inputs, out),
        Op::Addmm { beta, alpha } => matmul::addmm(*beta, *alpha, inputs, out),
        Op::Convolution(p) => conv::convolution(p, inputs, out),
        Op::Softmax { dim, log } => rows::softmax(*dim, *log, inputs, out),
        Op::LayerNorm {
            normalized_dims,
            eps,
        } => rows::layer_norm(*normalized_dims, *eps, inputs, out),
        Op::Reduce { op, dims, .. } => rows::reduce(*op, dims, inputs, out),
        _ => false,
    }
}

/// The shape of `op`'s one output for inputs of these shapes, where the op
/// states it or a rule the fast paths check gives it (`None`: another op,
/// or inputs that are not the rule's case). A caller whose outputs are
/// sized at run time (dynamic shapes) checks it against the bound before
/// anything is allocated and sizes the fast path's output view with it; the
/// fast path still checks every shape and declines what it does not take.
pub fn output_shape(op: &Op, inputs: &[Option<&[usize]>]) -> Option<Vec<usize>> {
    use etmetal_core::shape::broadcast_shapes;
    if let Op::Full { shape, .. } = op {
        return Some(shape.clone());
    }
    let x = inputs.first().copied().flatten()?;
    let y = || inputs.get(1).copied().flatten();
    match op {
        Op::Unary(_)
        | Op::Cast { .. }
        | Op::Identity
        | Op::Softmax { .. }
        | Op::LayerNorm { .. } => Some(x.to_vec()),
        Op::Reshape { shape } => Some(shape.clone()),
        Op::Binary(_) => broadcast_shapes(x, y()?).ok(),
        Op::Where => broadcast_shapes(
            &broadcast_shapes(x, y()?).ok()?,
            inputs.get(2).copied().flatten()?,
        )
        .ok(),
        Op::Permute { .. } | Op::Expand { .. } | Op::Slice { .. } | Op::Select { .. } => {
            crate::layout::strided_view(op, x)?.ok().map(|v| v.shape)
        }
        Op::MatMul => match (x, y()?) {
            (&[m, _], &[_, n]) => Some(vec![m, n]),
            (&[b, m, _], &[_, _, n]) => Some(vec![b, m, n]),
            _ => None,
        },
        // (bias, mat1, mat2)
        Op::Addmm { .. } => match (y()?, inputs.get(2).copied().flatten()?) {
            (&[m, _], &[_, n]) => Some(vec![m, n]),
            _ => None,
        },
        Op::Convolution(p) if !p.transposed => {
            let g = crate::conv::geometry(x, y()?, p).ok()?;
            Some([&[g.n, g.cout][..], &g.osp].concat())
        }
        _ => None,
    }
}

/// The output positions `o < outs` of a sliding window along one axis whose
/// tap `k` reads input position `o·stride + k·dil − pad` inside `0..size`:
/// a range `lo..hi` (empty when there are none).
fn valid_range(
    outs: usize,
    size: usize,
    k: usize,
    stride: usize,
    pad: usize,
    dil: usize,
) -> (usize, usize) {
    let shift = k * dil;
    // o·stride ≥ pad − shift
    let lo = pad.saturating_sub(shift).div_ceil(stride);
    // o·stride ≤ size − 1 + pad − shift
    let hi = match (size + pad).checked_sub(shift + 1) {
        Some(top) => (top / stride + 1).min(outs),
        None => 0,
    };
    (lo.min(hi), hi)
}

/// Call `f(r, row)` for each row `r` of `n` elements of `dst`, compiled wide
/// ([`simd`]), in parallel when the rows hold enough work (`work`
/// elements' worth each).
fn par_rows(dst: &mut [f32], n: usize, work: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if n == 0 {
        return;
    }
    let run = |(r, row): (usize, &mut [f32])| {
        simd::dispatch(
            #[inline(always)]
            || f(r, row),
        )
    };
    if dst.len() / n * work < PAR_MIN {
        dst.chunks_mut(n).enumerate().for_each(run);
    } else {
        dst.par_chunks_mut(n)
            .enumerate()
            .with_min_len((BLOCK / work.max(1)).max(1))
            .for_each(run);
    }
}

/// Every fast path against the reference kernel on the same inputs.
#[cfg(test)]
mod tests {
    use etmetal_core::{BinaryOp, ConvAttrs, DType, MaxPoolAttrs, Op, ReduceOp, Tensor, UnaryOp};

    use crate::view::{View, ViewMut};

    /// Values with negatives, zeros and fractions, varied by `seed`.
    fn data(shape: &[usize], seed: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 37 + seed * 11) % 29) as f32 / 7.0 - 2.0)
            .collect();
        Tensor::from_f32(DType::F32, shape, &v).unwrap()
    }

    /// Run `op` on the fast path (which must take it) and the reference;
    /// the results must agree to `tol` (relative to 1 + |reference|).
    fn check(op: Op, inputs: &[&Tensor], out: (DType, &[usize]), tol: f32) {
        let slots: Vec<Option<&Tensor>> = inputs.iter().map(|t| Some(*t)).collect();
        let want = crate::execute(&op, &slots, &[(out.0, out.1.to_vec())]).unwrap();
        let mut got = Tensor::zeros(out.0, out.1).unwrap();
        let views: Vec<Option<View>> = inputs.iter().map(|t| Some(View::of(t))).collect();
        let mut outs = [ViewMut {
            dtype: out.0,
            shape: out.1,
            bytes: got.bytes_mut(),
        }];
        assert!(
            crate::execute_into(&op, &views, &mut outs).unwrap(),
            "{op:?} on {:?} did not take the fast path",
            inputs.iter().map(|t| t.shape()).collect::<Vec<_>>()
        );
        let (g, w) = (got.to_f64_vec(), want[0].to_f64_vec());
        assert_eq!(g.len(), w.len());
        for (i, (g, w)) in g.iter().zip(&w).enumerate() {
            let ok = g == w
                || (g - w).abs() <= tol as f64 * (1.0 + w.abs())
                || (g.is_nan() && w.is_nan());
            assert!(ok, "{op:?} element {i}: fast {g}, reference {w}");
        }
    }

    fn scalar(v: f64) -> Tensor {
        Tensor::scalar_f64(DType::F32, v).unwrap()
    }

    #[test]
    fn pointwise_broadcasts_and_specials() {
        let shapes: [(&[usize], &[usize], &[usize]); 6] = [
            (&[3, 5, 7], &[3, 5, 7], &[3, 5, 7]),
            (&[2, 3, 4, 5], &[1, 3, 1, 1], &[2, 3, 4, 5]),
            (&[4, 1], &[1, 6], &[4, 6]),
            (&[7], &[], &[7]),
            (&[], &[2, 3], &[2, 3]),
            (&[300, 257], &[257], &[300, 257]),
        ];
        for (sa, sb, so) in shapes {
            let (a, b) = (data(sa, 1), data(sb, 2));
            for op in [
                BinaryOp::Add,
                BinaryOp::Sub,
                BinaryOp::Mul,
                BinaryOp::Div,
                BinaryOp::Maximum,
                BinaryOp::Minimum,
            ] {
                check(Op::Binary(op), &[&a, &b], (DType::F32, so), 1e-6);
            }
        }
        let mut v = data(&[40, 999], 3).to_f32_vec();
        v[..6].copy_from_slice(&[
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            30.0,
            -30.0,
        ]);
        let x = Tensor::from_f32(DType::F32, &[40, 999], &v).unwrap();
        for op in [
            UnaryOp::Relu,
            UnaryOp::Clamp {
                min: Some(0.0),
                max: Some(6.0),
            },
            UnaryOp::Clamp {
                min: None,
                max: Some(-0.5),
            },
            UnaryOp::Clamp {
                min: Some(f64::NAN),
                max: None,
            },
            UnaryOp::Gelu { tanh: false },
            UnaryOp::Gelu { tanh: true },
            UnaryOp::Sigmoid,
            UnaryOp::Silu,
            UnaryOp::Exp,
            UnaryOp::Rsqrt,
            UnaryOp::Neg,
            UnaryOp::PowScalar { exponent: 2.0 },
            UnaryOp::Tanh,
            UnaryOp::Abs,
        ] {
            check(Op::Unary(op), &[&x], (DType::F32, &[40, 999]), 1e-6);
        }
        let cond = Tensor::from_i64(DType::Bool, &[3, 1], &[1, 0, 1]).unwrap();
        let row = Tensor::from_i64(DType::Bool, &[1, 4], &[0, 1, 1, 0]).unwrap();
        let (full, col) = (data(&[3, 4], 1), data(&[3, 1], 2));
        for (c, a, b) in [
            (&cond, &full, &scalar(-1e9)),
            (&row, &full, &col),
            (&row, &scalar(2.0), &full),
            (&cond, &col, &full),
        ] {
            check(Op::Where, &[c, a, b], (DType::F32, &[3, 4]), 0.0);
        }
    }

    #[test]
    fn moves_keep_every_dtype_exact() {
        for dtype in [DType::F32, DType::I64, DType::Bool, DType::BF16, DType::U8] {
            let x = data(&[2, 3, 4], 1).cast(dtype).unwrap();
            let y = data(&[2, 5, 4], 2).cast(dtype).unwrap();
            let out = |s: &'static [usize]| (dtype, s);
            check(
                Op::Permute {
                    dims: vec![2, 0, 1],
                },
                &[&x],
                out(&[4, 2, 3]),
                0.0,
            );
            check(
                Op::Permute {
                    dims: vec![0, 2, 1],
                },
                &[&x],
                out(&[2, 4, 3]),
                0.0,
            );
            check(
                Op::Expand {
                    shape: vec![3, 2, 3, 4],
                },
                &[&x],
                out(&[3, 2, 3, 4]),
                0.0,
            );
            let slice = Op::Slice {
                dim: 2,
                start: 1,
                end: 4,
                step: 2,
            };
            check(slice, &[&x], out(&[2, 3, 2]), 0.0);
            check(Op::Select { dim: 1, index: 2 }, &[&x], out(&[2, 4]), 0.0);
            check(Op::Reshape { shape: vec![6, 4] }, &[&x], out(&[6, 4]), 0.0);
            check(Op::Cat { dim: 1 }, &[&x, &y, &x], out(&[2, 11, 4]), 0.0);
            check(Op::Cast { dtype }, &[&x], out(&[2, 3, 4]), 0.0);
            let idx = Tensor::from_i64(DType::I64, &[5], &[1, 0, 1, 1, 0]).unwrap();
            for (dim, shape) in [(0, &[5, 3, 4][..]), (1, &[2, 5, 4]), (2, &[2, 3, 5])] {
                check(Op::IndexSelect { dim }, &[&x, &idx], (dtype, shape), 0.0);
            }
            let table = data(&[3, 4], 3).cast(dtype).unwrap();
            let ids = Tensor::from_i64(DType::I64, &[1, 5], &[2, 0, 2, 1, 0]).unwrap();
            check(Op::Embedding, &[&table, &ids], out(&[1, 5, 4]), 0.0);
        }
        // a column of one broadcast along the last dim
        let col = data(&[3, 1], 4);
        check(
            Op::Expand { shape: vec![3, 5] },
            &[&col],
            (DType::F32, &[3, 5]),
            0.0,
        );
    }

    #[test]
    fn rows_match_the_f64_reference() {
        let mut v = data(&[6, 77], 5).to_f32_vec();
        v[77..154].fill(f32::NEG_INFINITY); // a fully masked row is NaN in both
        v[200] = f32::NEG_INFINITY;
        let x = Tensor::from_f32(DType::F32, &[6, 77], &v).unwrap();
        for log in [false, true] {
            check(
                Op::Softmax { dim: 1, log },
                &[&x],
                (DType::F32, &[6, 77]),
                1e-6,
            );
        }
        let big = data(&[300, 700], 6);
        check(
            Op::Softmax { dim: 1, log: false },
            &[&big],
            (DType::F32, &[300, 700]),
            1e-6,
        );
        let x = data(&[5, 3, 64], 7);
        let (w, b) = (data(&[3, 64], 8), data(&[3, 64], 9));
        let ln = Op::LayerNorm {
            normalized_dims: 2,
            eps: 1e-5,
        };
        check(ln.clone(), &[&x, &w, &b], (DType::F32, &[5, 3, 64]), 1e-5);
        check(ln, &[&x], (DType::F32, &[5, 3, 64]), 1e-5);
        for (op, keepdim, shape) in [
            (ReduceOp::Mean, true, &[5, 3, 1][..]),
            (ReduceOp::Sum, false, &[5, 3][..]),
        ] {
            let r = Op::Reduce {
                op,
                dims: vec![2],
                keepdim,
            };
            check(r, &[&x], (DType::F32, shape), 1e-6);
        }
        let all = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![2, 1],
            keepdim: false,
        };
        check(all, &[&x], (DType::F32, &[5]), 1e-6);
    }

    #[test]
    fn convolutions_of_every_kind() {
        let conv = |stride: &[usize], padding: &[usize], dilation: &[usize], groups| {
            Op::Convolution(ConvAttrs {
                stride: stride.to_vec(),
                padding: padding.to_vec(),
                dilation: dilation.to_vec(),
                transposed: false,
                output_padding: vec![],
                groups,
            })
        };
        // (input, weight, output, stride, padding, dilation, groups)
        type Case = (
            &'static [usize],
            &'static [usize],
            &'static [usize],
            &'static [usize],
            &'static [usize],
            &'static [usize],
            usize,
        );
        let cases: [Case; 9] = [
            // 3×3 with padding, odd sizes, two images
            (
                &[2, 3, 9, 7],
                &[5, 3, 3, 3],
                &[2, 5, 9, 7],
                &[1, 1],
                &[1, 1],
                &[1, 1],
                1,
            ),
            // stride 2, 7×7, padding 3 (a ResNet stem)
            (
                &[1, 3, 15, 13],
                &[4, 3, 7, 7],
                &[1, 4, 8, 7],
                &[2, 2],
                &[3, 3],
                &[1, 1],
                1,
            ),
            // 1×1 (a plain GEMM) and 1×1 with stride 2 (im2col)
            (
                &[1, 6, 5, 5],
                &[4, 6, 1, 1],
                &[1, 4, 5, 5],
                &[1, 1],
                &[0, 0],
                &[1, 1],
                1,
            ),
            (
                &[1, 6, 5, 5],
                &[4, 6, 1, 1],
                &[1, 4, 3, 3],
                &[2, 2],
                &[0, 0],
                &[1, 1],
                1,
            ),
            // depthwise, stride 1 and 2, and with dilation
            (
                &[1, 8, 9, 10],
                &[8, 1, 3, 3],
                &[1, 8, 9, 10],
                &[1, 1],
                &[1, 1],
                &[1, 1],
                8,
            ),
            (
                &[1, 8, 9, 10],
                &[8, 1, 3, 3],
                &[1, 8, 5, 5],
                &[2, 2],
                &[1, 1],
                &[1, 1],
                8,
            ),
            (
                &[1, 4, 9, 9],
                &[4, 1, 3, 3],
                &[1, 4, 7, 7],
                &[1, 1],
                &[1, 1],
                &[2, 2],
                4,
            ),
            // grouped, two channels a group, and a channel multiplier
            (
                &[1, 4, 6, 6],
                &[6, 2, 3, 3],
                &[1, 6, 4, 4],
                &[1, 1],
                &[0, 0],
                &[1, 1],
                2,
            ),
            (
                &[1, 2, 6, 6],
                &[4, 1, 3, 3],
                &[1, 4, 6, 6],
                &[1, 1],
                &[1, 1],
                &[1, 1],
                2,
            ),
        ];
        for (xs, ws, ys, s, p, d, g) in cases {
            let (x, w, b) = (data(xs, 1), data(ws, 2), data(&[ws[0]], 3));
            check(conv(s, p, d, g), &[&x, &w, &b], (DType::F32, ys), 1e-5);
            check(conv(s, p, d, g), &[&x, &w], (DType::F32, ys), 1e-5);
        }
        // 1-D: whisper's stem (kernel 3, padding 1) and its stride-2 layer
        let (x, w, b) = (data(&[1, 5, 30], 4), data(&[6, 5, 3], 5), data(&[6], 6));
        check(
            conv(&[1], &[1], &[1], 1),
            &[&x, &w, &b],
            (DType::F32, &[1, 6, 30]),
            1e-5,
        );
        check(
            conv(&[2], &[1], &[1], 1),
            &[&x, &w, &b],
            (DType::F32, &[1, 6, 15]),
            1e-5,
        );
    }

    #[test]
    fn max_pools_with_and_without_indices() {
        let mut v = data(&[2, 3, 9, 8], 1).to_f32_vec();
        v[5] = f32::NAN;
        let x = Tensor::from_f32(DType::F32, &[2, 3, 9, 8], &v).unwrap();
        // (kernel, stride, padding, dilation, ceil, output)
        type Case = (usize, usize, usize, usize, bool, [usize; 2]);
        let cases: [Case; 4] = [
            (3, 2, 1, 1, false, [5, 4]),
            (2, 2, 0, 1, true, [5, 4]),
            (3, 1, 1, 2, false, [7, 6]),
            (3, 3, 0, 1, true, [3, 3]),
        ];
        for (k, s, p, d, ceil, [oh, ow]) in cases {
            for with_indices in [false, true] {
                let op = Op::MaxPool(MaxPoolAttrs {
                    kernel: vec![k, k],
                    stride: vec![s],
                    padding: vec![p, p],
                    dilation: vec![d, d],
                    ceil_mode: ceil,
                    with_indices,
                });
                let shape = [2, 3, oh, ow];
                let mut specs = vec![(DType::F32, shape.to_vec())];
                if with_indices {
                    specs.push((DType::I64, shape.to_vec()));
                }
                let want = crate::execute(&op, &[Some(&x)], &specs).unwrap();
                let mut got: Vec<Tensor> = specs
                    .iter()
                    .map(|(t, s)| Tensor::zeros(*t, s).unwrap())
                    .collect();
                let mut outs: Vec<ViewMut> = got
                    .iter_mut()
                    .zip(&specs)
                    .map(|(t, (dtype, s))| ViewMut {
                        dtype: *dtype,
                        shape: s,
                        bytes: t.bytes_mut(),
                    })
                    .collect();
                assert!(crate::execute_into(&op, &[Some(View::of(&x))], &mut outs).unwrap());
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(g.bytes(), w.bytes(), "{op:?}");
                }
            }
        }
    }

    #[test]
    fn declined_cases_write_nothing() {
        // bf16 arithmetic, softmax off the last dim and an index out of
        // range are the reference's
        let x = data(&[2, 3], 1);
        let b = x.cast(DType::BF16).unwrap();
        let far = Tensor::from_i64(DType::I64, &[2], &[0, 2]).unwrap();
        for (op, input) in [
            (Op::Binary(BinaryOp::Add), vec![&b, &b]),
            (Op::Softmax { dim: 0, log: false }, vec![&x]),
            (Op::IndexSelect { dim: 0 }, vec![&x, &far]),
        ] {
            let dtype = input[0].dtype();
            let mut y = Tensor::zeros(dtype, &[2, 3]).unwrap();
            let views: Vec<Option<View>> = input.iter().map(|t| Some(View::of(t))).collect();
            let mut outs = [ViewMut {
                dtype,
                shape: &[2, 3],
                bytes: y.bytes_mut(),
            }];
            assert!(
                !crate::execute_into(&op, &views, &mut outs).unwrap(),
                "{op:?}"
            );
            assert!(y.bytes().iter().all(|&b| b == 0));
        }
    }
}
