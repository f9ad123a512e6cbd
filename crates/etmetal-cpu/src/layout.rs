//! Ops that only move elements: reshape, permute, expand, slice, select,
//! cat, constant pad, triangle masks and repeat. They work on raw elements of
//! the dtype's width, so every dtype is handled exactly.

use etmetal_core::shape::contiguous_strides;
use etmetal_core::{Op, Result, Tensor};

use crate::ctx::Ctx;
use crate::strided::{by_width, for_each_offset, materialize};

pub fn reshape(ctx: &Ctx, shape: &[usize]) -> Result<Tensor> {
    let x = ctx.input(0)?;
    x.reshape(shape).map_err(|e| ctx.invalid(e.message()))
}

/// The strided view of its input that a view op (permute, expand, slice,
/// select) copies out: shape, strides and offset in elements of the input.
pub(crate) struct Strided {
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
}

/// What view op `op` reads of an input of shape `x`: `None` for other ops,
/// the reason as `Err` when the op does not apply to `x`.
pub(crate) fn strided_view(op: &Op, x: &[usize]) -> Option<std::result::Result<Strided, String>> {
    Some(match op {
        Op::Permute { dims } => permute_view(x, dims),
        Op::Expand { shape } => expand_view(x, shape),
        Op::Slice {
            dim,
            start,
            end,
            step,
        } => slice_view(x, *dim, *start, *end, *step),
        Op::Select { dim, index } => select_view(x, *dim, *index),
        _ => return None,
    })
}

/// The reference kernel of the view ops: a contiguous copy of the view.
pub fn view(ctx: &Ctx) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let v = strided_view(ctx.op, x.shape())
        .ok_or_else(|| ctx.unsupported("not a view op"))?
        .map_err(|m| ctx.invalid(m))?;
    materialize(x, &v.shape, &v.strides, v.offset)
}

fn permute_view(x: &[usize], dims: &[usize]) -> std::result::Result<Strided, String> {
    let mut seen = vec![false; x.len()];
    let bad = dims.len() != x.len()
        || dims
            .iter()
            .any(|&d| d >= x.len() || std::mem::replace(&mut seen[d], true));
    if bad {
        return Err(format!(
            "{dims:?} is not a permutation of the dims of shape {x:?}"
        ));
    }
    let strides = contiguous_strides(x);
    Ok(Strided {
        shape: dims.iter().map(|&d| x[d]).collect(),
        strides: dims.iter().map(|&d| strides[d]).collect(),
        offset: 0,
    })
}

fn expand_view(x: &[usize], shape: &[usize]) -> std::result::Result<Strided, String> {
    let bad = || format!("cannot expand shape {x:?} to {shape:?}");
    let lead = shape.len().checked_sub(x.len()).ok_or_else(bad)?;
    let src = contiguous_strides(x);
    let mut strides = vec![0; shape.len()];
    for (i, &d) in x.iter().enumerate() {
        match d {
            _ if d == shape[lead + i] => strides[lead + i] = src[i],
            1 => {}
            _ => return Err(bad()),
        }
    }
    Ok(Strided {
        shape: shape.to_vec(),
        strides,
        offset: 0,
    })
}

fn slice_view(
    x: &[usize],
    dim: usize,
    start: usize,
    end: usize,
    step: usize,
) -> std::result::Result<Strided, String> {
    let size = x.get(dim).copied();
    if step == 0 || start > end || size.is_none_or(|s| end > s) {
        return Err(format!(
            "slice {start}..{end} step {step} of dim {dim} is invalid for shape {x:?}"
        ));
    }
    let mut strides = contiguous_strides(x);
    let mut shape = x.to_vec();
    shape[dim] = (end - start).div_ceil(step);
    let offset = if shape[dim] == 0 {
        0
    } else {
        start * strides[dim]
    };
    strides[dim] *= step;
    Ok(Strided {
        shape,
        strides,
        offset,
    })
}

fn select_view(x: &[usize], dim: usize, index: usize) -> std::result::Result<Strided, String> {
    if x.get(dim).is_none_or(|&s| index >= s) {
        return Err(format!(
            "index {index} of dim {dim} is out of range for shape {x:?}"
        ));
    }
    let mut strides = contiguous_strides(x);
    let mut shape = x.to_vec();
    let offset = index * strides[dim];
    shape.remove(dim);
    strides.remove(dim);
    Ok(Strided {
        shape,
        strides,
        offset,
    })
}

pub fn cat(ctx: &Ctx, dim: usize) -> Result<Tensor> {
    let out = ctx.out_dtype(0)?;
    let all = (0..ctx.inputs.len())
        .map(|i| ctx.input(i))
        .collect::<Result<Vec<_>>>()?;
    let rank = all.iter().map(|t| t.rank()).max().unwrap_or(0);
    // PyTorch still accepts (and skips) legacy 1-D empty tensors next to others
    let parts: Vec<Tensor> = all
        .iter()
        .filter(|t| !(t.shape() == [0] && rank > 1))
        .map(|t| t.cast(out))
        .collect::<Result<_>>()?;
    let first = parts.first().ok_or_else(|| ctx.invalid("no inputs"))?;
    if dim >= first.rank() {
        return Err(ctx.invalid(format!(
            "dim {dim} is out of range for shape {:?}",
            first.shape()
        )));
    }
    let mut shape = first.shape().to_vec();
    shape[dim] = 0;
    for (i, p) in parts.iter().enumerate() {
        let same = p.rank() == first.rank()
            && (0..p.rank()).all(|d| d == dim || p.shape()[d] == first.shape()[d]);
        if !same {
            return Err(ctx.invalid(format!(
                "input {i} of shape {:?} does not match {:?} outside dim {dim}",
                p.shape(),
                first.shape()
            )));
        }
        shape[dim] += p.shape()[dim];
    }
    let outer: usize = shape[..dim].iter().product();
    let chunk = |t: &Tensor| t.nbytes() / outer.max(1);
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.nbytes()).sum());
    for o in 0..outer {
        for p in &parts {
            let c = chunk(p);
            bytes.extend_from_slice(&p.bytes()[o * c..(o + 1) * c]);
        }
    }
    Tensor::from_bytes(out, &shape, &bytes)
}

pub fn constant_pad(ctx: &Ctx, pad: &[i64], value: f64) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let rank = x.rank();
    if !pad.len().is_multiple_of(2) || pad.len() > 2 * rank {
        return Err(ctx.invalid(format!("pad {pad:?} needs pairs for at most {rank} dims")));
    }
    let mut shape = x.shape().to_vec();
    let (mut src_start, mut dst_start, mut len) =
        (vec![0; rank], vec![0; rank], x.shape().to_vec());
    for (i, p) in pad.chunks_exact(2).enumerate() {
        let d = rank - 1 - i;
        let size = x.shape()[d] as i64 + p[0] + p[1];
        if size < 0 {
            return Err(ctx.invalid(format!(
                "pad {pad:?} leaves dim {d} of shape {:?} negative",
                x.shape()
            )));
        }
        shape[d] = size as usize;
        src_start[d] = (-p[0]).max(0) as usize;
        dst_start[d] = p[0].max(0) as usize;
        len[d] =
            (x.shape()[d].saturating_sub(src_start[d])).min(shape[d].saturating_sub(dst_start[d]));
    }
    let fill = Tensor::from_f64(x.dtype(), &[], &[value])?;
    let (ss, ds) = (contiguous_strides(x.shape()), contiguous_strides(&shape));
    let at = |start: &[usize], strides: &[usize]| {
        start.iter().zip(strides).map(|(a, b)| a * b).sum::<usize>()
    };
    let n = etmetal_core::shape::numel(&shape)?;
    by_width!(x.dtype(), T => {
        let src = x.values::<T>()?;
        let mut out = vec![fill.values::<T>()?[0]; n];
        for_each_offset(&len, [&ss, &ds], [at(&src_start, &ss), at(&dst_start, &ds)], |[s, d]| out[d] = src[s]);
        Tensor::from_slice(x.dtype(), &shape, &out)
    })
}

pub fn triangle(ctx: &Ctx, upper: bool, diagonal: i64) -> Result<Tensor> {
    let x = ctx.input(0)?;
    if x.rank() < 2 {
        return Err(ctx.invalid(format!("needs at least 2 dims, got shape {:?}", x.shape())));
    }
    let (m, n) = (x.shape()[x.rank() - 2], x.shape()[x.rank() - 1]);
    let mut y = x.clone();
    let w = x.dtype().size();
    let bytes = y.bytes_mut();
    if m * n > 0 {
        for mat in bytes.chunks_exact_mut(m * n * w) {
            for i in 0..m {
                for j in 0..n {
                    let k = j as i64 - i as i64;
                    let keep = if upper { k >= diagonal } else { k <= diagonal };
                    if !keep {
                        mat[(i * n + j) * w..(i * n + j + 1) * w].fill(0);
                    }
                }
            }
        }
    }
    Ok(y)
}

pub fn repeat(ctx: &Ctx, repeats: &[usize]) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let lead = repeats.len().checked_sub(x.rank()).ok_or_else(|| {
        ctx.invalid(format!(
            "{} repeats given for a rank-{} tensor",
            repeats.len(),
            x.rank()
        ))
    })?;
    // view x (padded with leading 1s) as [r0, d0, r1, d1, …] with stride 0 on each r
    let dims: Vec<usize> = std::iter::repeat_n(1, lead)
        .chain(x.shape().iter().copied())
        .collect();
    let src = contiguous_strides(&dims);
    let (mut vshape, mut vstrides) = (vec![], vec![]);
    for (i, &r) in repeats.iter().enumerate() {
        vshape.extend([r, dims[i]]);
        vstrides.extend([0, src[i]]);
    }
    let shape: Vec<usize> = repeats.iter().zip(&dims).map(|(r, d)| r * d).collect();
    etmetal_core::shape::numel(&shape)?;
    materialize(x, &vshape, &vstrides, 0)?.reshape(&shape)
}

#[cfg(test)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{DType, ErrorKind, Op, Tensor};

    fn x23() -> Tensor {
        i64t(&[2, 3], &[0, 1, 2, 3, 4, 5])
    }

    #[test]
    fn views_permute_expand_slice_select() {
        let x = x23();
        assert_eq!(
            run1(Op::Permute { dims: vec![1, 0] }, &[&x], DType::I64, &[3, 2])
                .unwrap()
                .to_i64_vec(),
            vec![0, 3, 1, 4, 2, 5]
        );
        let e = run1(
            Op::Expand {
                shape: vec![2, 2, 3],
            },
            &[&x],
            DType::I64,
            &[2, 2, 3],
        )
        .unwrap();
        assert_eq!(e.to_i64_vec(), vec![0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]);
        let col = f32t(&[2, 1], &[1.0, 2.0]);
        assert_eq!(
            run1(
                Op::Expand { shape: vec![2, 3] },
                &[&col],
                DType::F32,
                &[2, 3]
            )
            .unwrap()
            .to_f32_vec(),
            vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        );
        assert!(run1(Op::Expand { shape: vec![3, 3] }, &[&x], DType::I64, &[3, 3]).is_err());
        let s = run1(
            Op::Slice {
                dim: 1,
                start: 0,
                end: 3,
                step: 2,
            },
            &[&x],
            DType::I64,
            &[2, 2],
        )
        .unwrap();
        assert_eq!(s.to_i64_vec(), vec![0, 2, 3, 5]);
        let s = run1(
            Op::Slice {
                dim: 1,
                start: 3,
                end: 3,
                step: 1,
            },
            &[&x],
            DType::I64,
            &[2, 0],
        )
        .unwrap();
        assert_eq!(s.numel(), 0);
        assert_eq!(
            run1(Op::Select { dim: 0, index: 1 }, &[&x], DType::I64, &[3])
                .unwrap()
                .to_i64_vec(),
            vec![3, 4, 5]
        );
        let e = run1(Op::Select { dim: 1, index: 3 }, &[&x], DType::I64, &[2]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert_eq!(
            run1(
                Op::Reshape {
                    shape: vec![3, 1, 2]
                },
                &[&x],
                DType::I64,
                &[3, 1, 2]
            )
            .unwrap()
            .shape(),
            &[3, 1, 2]
        );
        assert!(run1(Op::Reshape { shape: vec![4] }, &[&x], DType::I64, &[4]).is_err());
    }

    #[test]
    fn cat_promotes_and_skips_legacy_empty() {
        let a = x23();
        let b = Tensor::from_i64(DType::I32, &[2, 1], &[9, 8]).unwrap();
        let empty = f32t(&[0], &[]);
        let op = Op::Cat { dim: 1 };
        let y = crate::execute(
            &op,
            &[Some(&a), Some(&empty), Some(&b)],
            &[(DType::I64, vec![2, 4])],
        )
        .unwrap();
        assert_eq!(y[0].to_i64_vec(), vec![0, 1, 2, 9, 3, 4, 5, 8]);
        let y = crate::execute(
            &Op::Cat { dim: 0 },
            &[Some(&b), Some(&b)],
            &[(DType::I32, vec![4, 1])],
        )
        .unwrap();
        assert_eq!(y[0].to_i64_vec(), vec![9, 8, 9, 8]);
        let e = crate::execute(
            &Op::Cat { dim: 0 },
            &[Some(&a), Some(&b)],
            &[(DType::I64, vec![4, 3])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("does not match"), "{e}");
    }

    #[test]
    fn pad_triangle_repeat() {
        let x = f32t(&[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        // pad last dim by (1, -1) and the first by (0, 1): crop one column, add one
        let y = run1(
            Op::ConstantPad {
                pad: vec![1, -1, 0, 1],
                value: 7.0,
            },
            &[&x],
            DType::F32,
            &[3, 3],
        )
        .unwrap();
        assert_eq!(
            y.to_f32_vec(),
            vec![7.0, 0.0, 1.0, 7.0, 3.0, 4.0, 7.0, 7.0, 7.0]
        );
        let b = Tensor::from_f32(DType::BF16, &[1, 1], &[1.5]).unwrap();
        let y = run1(
            Op::ConstantPad {
                pad: vec![1, 0],
                value: 0.1,
            },
            &[&b],
            DType::BF16,
            &[1, 2],
        )
        .unwrap();
        assert_eq!(y.to_f32_vec(), vec![205.0 / 2048.0, 1.5]);
        let t = run1(
            Op::Triangle {
                upper: true,
                diagonal: 1,
            },
            &[&x],
            DType::F32,
            &[2, 3],
        )
        .unwrap();
        assert_eq!(t.to_f32_vec(), vec![0.0, 1.0, 2.0, 0.0, 0.0, 5.0]);
        let t = run1(
            Op::Triangle {
                upper: false,
                diagonal: -1,
            },
            &[&x],
            DType::F32,
            &[2, 3],
        )
        .unwrap();
        assert_eq!(t.to_f32_vec(), vec![0.0, 0.0, 0.0, 3.0, 0.0, 0.0]);
        let r = run1(
            Op::Repeat {
                repeats: vec![2, 1, 2],
            },
            &[&f32t(&[1, 2], &[1.0, 2.0])],
            DType::F32,
            &[2, 1, 4],
        )
        .unwrap();
        assert_eq!(r.to_f32_vec(), vec![1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]);
    }
}
