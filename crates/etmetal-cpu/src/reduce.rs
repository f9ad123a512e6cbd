//! Reductions: sum/mean/max/min/prod/any/all over any dims, var, arg-max/min,
//! max/min with indices, cumsum, softmax and top-k. Float sums accumulate in
//! f64 and are rounded once on store.

use etmetal_core::{ReduceOp, Result, Tensor};

use crate::buf::{load, with_ordered, Buf, Domain, Elem};
use crate::ctx::Ctx;
use crate::strided::gather;

/// Which dims of a rank-`rank` tensor are reduced (all when `dims` is empty).
fn reduced_mask(ctx: &Ctx, rank: usize, dims: &[usize]) -> Result<Vec<bool>> {
    let mut mask = vec![dims.is_empty(); rank];
    for &d in dims {
        if d >= rank.max(1) {
            return Err(ctx.invalid(format!("dim {d} is out of range for rank {rank}")));
        }
        if rank > 0 {
            if mask[d] {
                return Err(ctx.invalid(format!("dim {d} appears twice in {dims:?}")));
            }
            mask[d] = true;
        }
    }
    Ok(mask)
}

fn reduced_shape(shape: &[usize], mask: &[bool], keepdim: bool) -> Vec<usize> {
    shape
        .iter()
        .zip(mask)
        .filter_map(|(&d, &m)| match (m, keepdim) {
            (false, _) => Some(d),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

/// The elements reordered so that each output element's reduced values are
/// contiguous; returns them with the length `r` of each group.
fn group_reduced<T: Copy>(v: &[T], shape: &[usize], mask: &[bool]) -> (Vec<T>, usize) {
    let strides = etmetal_core::shape::contiguous_strides(shape);
    let order: Vec<usize> = (0..shape.len())
        .filter(|&d| !mask[d])
        .chain((0..shape.len()).filter(|&d| mask[d]))
        .collect();
    let r = (0..shape.len())
        .filter(|&d| mask[d])
        .map(|d| shape[d])
        .product();
    let pshape: Vec<usize> = order.iter().map(|&d| shape[d]).collect();
    let pstrides: Vec<usize> = order.iter().map(|&d| strides[d]).collect();
    (gather(v, &pshape, &pstrides, 0), r)
}

/// Apply `f` to each group of `r` consecutive values (`groups` of them).
fn per_group<T, U>(v: &[T], r: usize, groups: usize, f: impl Fn(&[T]) -> U) -> Vec<U> {
    if r == 0 {
        return (0..groups).map(|_| f(&[])).collect();
    }
    v.chunks_exact(r).map(f).collect()
}

/// Max or min of a group, NaN winning as in PyTorch; `None` when empty.
fn extreme<T: Elem>(g: &[T], max: bool) -> Option<T> {
    let mut it = g.iter().copied();
    let first = it.next()?;
    Some(it.fold(first, |best, v| {
        #[allow(clippy::eq_op)]
        let nan = |x: T| x != x;
        if nan(best) {
            best
        } else if nan(v) || (max && v > best) || (!max && v < best) {
            v
        } else {
            best
        }
    }))
}

pub fn reduce(ctx: &Ctx, op: ReduceOp, dims: &[usize], keepdim: bool) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = ctx.out_dtype(0)?;
    let mask = reduced_mask(ctx, x.rank(), dims)?;
    let oshape = reduced_shape(x.shape(), &mask, keepdim);
    let groups = oshape.iter().product();
    let buf = match op {
        ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod => {
            if out.is_float() {
                let (v, r) = group_reduced(&x.to_f64_vec(), x.shape(), &mask);
                Buf::F64(per_group(&v, r, groups, |g| match op {
                    ReduceOp::Sum => g.iter().sum(),
                    ReduceOp::Mean => g.iter().sum::<f64>() / r as f64,
                    _ => g.iter().product(),
                }))
            } else if op == ReduceOp::Mean {
                return Err(ctx.unsupported(format!(
                    "mean needs a floating-point output dtype, got {out}"
                )));
            } else {
                let (v, r) = group_reduced(&x.to_i64_vec(), x.shape(), &mask);
                Buf::I64(per_group(&v, r, groups, |g| match op {
                    ReduceOp::Sum => g.iter().fold(0i64, |a, &b| a.wrapping_add(b)),
                    _ => g.iter().fold(1i64, |a, &b| a.wrapping_mul(b)),
                }))
            }
        }
        ReduceOp::Max | ReduceOp::Min => {
            if x.numel() == 0 {
                return Err(ctx.invalid(format!(
                    "cannot take the max/min of an empty tensor of shape {:?}",
                    x.shape()
                )));
            }
            let max = op == ReduceOp::Max;
            with_ordered!(x, v => {
                let (v, r) = group_reduced(&v, x.shape(), &mask);
                Elem::wrap(per_group(&v, r, groups, |g| extreme(g, max).unwrap_or(v[0])))
            })
        }
        ReduceOp::Any | ReduceOp::All => {
            let Buf::Bool(v) = load(x, Domain::Bool) else {
                unreachable!("bool domain")
            };
            let (v, r) = group_reduced(&v, x.shape(), &mask);
            let any = op == ReduceOp::Any;
            Buf::Bool(per_group(&v, r, groups, |g| {
                if any {
                    g.iter().any(|&b| b)
                } else {
                    g.iter().all(|&b| b)
                }
            }))
        }
    };
    buf.store(out, &oshape)
}

pub fn var(ctx: &Ctx, dims: &[usize], correction: f64, keepdim: bool) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let mask = reduced_mask(ctx, x.rank(), dims)?;
    let oshape = reduced_shape(x.shape(), &mask, keepdim);
    let (v, r) = group_reduced(&x.to_f64_vec(), x.shape(), &mask);
    let res = per_group(&v, r, oshape.iter().product(), |g| {
        let mean = g.iter().sum::<f64>() / r as f64;
        let ssd: f64 = g.iter().map(|&e| (e - mean) * (e - mean)).sum();
        ssd / (r as f64 - correction).max(0.0)
    });
    Buf::F64(res).store(ctx.out_dtype(0)?, &oshape)
}

/// `(outer, n, inner)` of a tensor seen as `[outer, shape[dim], inner]`.
fn split3(ctx: &Ctx, shape: &[usize], dim: usize) -> Result<(usize, usize, usize)> {
    if shape.is_empty() && dim == 0 {
        return Ok((1, 1, 1));
    }
    if dim >= shape.len() {
        return Err(ctx.invalid(format!("dim {dim} is out of range for shape {shape:?}")));
    }
    Ok((
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    ))
}

/// For each `(outer, inner)` line along the middle dim, in `o * inner + i`
/// order, call `f` with an accessor of the line's values.
fn lines<T: Copy, U>(
    v: &[T],
    (outer, n, inner): (usize, usize, usize),
    mut f: impl FnMut(&dyn Fn(usize) -> T) -> U,
) -> Vec<U> {
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let base = o * n * inner + i;
            out.push(f(&|j| v[base + j * inner]));
        }
    }
    out
}

/// Index of the first max (min) along a line, NaN counting as the max.
fn best_index<T: Elem>(get: &dyn Fn(usize) -> T, n: usize, max: bool) -> usize {
    #[allow(clippy::eq_op)]
    let nan = |x: T| x != x;
    let mut best = 0;
    for j in 1..n {
        let (b, v) = (get(best), get(j));
        if nan(b) {
            break;
        }
        if nan(v) || (max && v > b) || (!max && v < b) {
            best = j;
        }
    }
    best
}

pub fn arg_reduce(ctx: &Ctx, max: bool, dim: Option<usize>, keepdim: bool) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let (parts, oshape) = match dim {
        None => (
            (1, x.numel(), 1),
            if keepdim { vec![1; x.rank()] } else { vec![] },
        ),
        Some(d) => {
            let p = split3(ctx, x.shape(), d)?;
            let mask: Vec<bool> = (0..x.rank()).map(|i| i == d).collect();
            (p, reduced_shape(x.shape(), &mask, keepdim))
        }
    };
    if parts.1 == 0 {
        return Err(ctx.invalid(format!(
            "cannot take the arg max/min over an empty dim of shape {:?}",
            x.shape()
        )));
    }
    let idx: Vec<i64> =
        with_ordered!(x, v => lines(&v, parts, |get| best_index(get, parts.1, max) as i64));
    Buf::I64(idx).store(ctx.out_dtype(0)?, &oshape)
}

pub fn reduce_with_indices(ctx: &Ctx, max: bool, dim: usize, keepdim: bool) -> Result<Vec<Tensor>> {
    let x = ctx.input(0)?;
    let parts = split3(ctx, x.shape(), dim)?;
    if parts.1 == 0 {
        return Err(ctx.invalid(format!(
            "cannot take the max/min over an empty dim of shape {:?}",
            x.shape()
        )));
    }
    let mask: Vec<bool> = (0..x.rank()).map(|i| i == dim).collect();
    let oshape = reduced_shape(x.shape(), &mask, keepdim);
    let (values, idx) = with_ordered!(x, v => {
        let pairs = lines(&v, parts, |get| {
            let j = best_index(get, parts.1, max);
            (get(j), j as i64)
        });
        let (vals, idx): (Vec<_>, Vec<i64>) = pairs.into_iter().unzip();
        (Elem::wrap(vals), idx)
    });
    Ok(vec![
        values.store(ctx.out_dtype(0)?, &oshape)?,
        Buf::I64(idx).store(ctx.out_dtype(1)?, &oshape)?,
    ])
}

/// Write per-line results (`n` values for line `l`) back in `[outer, n, inner]` order.
fn scatter_lines<T: Copy + Default>(
    lines: Vec<Vec<T>>,
    (_, n, inner): (usize, usize, usize),
) -> Vec<T> {
    let mut out = vec![T::default(); lines.len() * n];
    for (l, line) in lines.into_iter().enumerate() {
        let (o, i) = (l / inner, l % inner);
        for (j, v) in line.into_iter().enumerate() {
            out[(o * n + j) * inner + i] = v;
        }
    }
    out
}

pub fn cumsum(ctx: &Ctx, dim: usize) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = ctx.out_dtype(0)?;
    let parts = split3(ctx, x.shape(), dim)?;
    let buf = if out.is_float() {
        let v = x.to_f64_vec();
        let ls = lines(&v, parts, |get| {
            (0..parts.1)
                .scan(0.0, |acc, j| {
                    *acc += get(j);
                    Some(*acc)
                })
                .collect()
        });
        Buf::F64(scatter_lines(ls, parts))
    } else {
        let v = x.to_i64_vec();
        let ls = lines(&v, parts, |get| {
            (0..parts.1)
                .scan(0i64, |acc, j| {
                    *acc = acc.wrapping_add(get(j));
                    Some(*acc)
                })
                .collect()
        });
        Buf::I64(scatter_lines(ls, parts))
    };
    buf.store(out, x.shape())
}

pub fn softmax(ctx: &Ctx, dim: usize, log: bool) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = ctx.out_dtype(0)?;
    if !out.is_float() {
        return Err(ctx.unsupported(format!(
            "softmax needs a floating-point output dtype, got {out}"
        )));
    }
    let parts = split3(ctx, x.shape(), dim)?;
    let v = x.to_f64_vec();
    let ls = lines(&v, parts, |get| {
        let n = parts.1;
        let m = (0..n).map(get).fold(
            f64::NEG_INFINITY,
            |a, b| if b > a || b.is_nan() { b } else { a },
        );
        let sum: f64 = (0..n).map(|j| (get(j) - m).exp()).sum();
        (0..n)
            .map(|j| {
                if log {
                    get(j) - m - sum.ln()
                } else {
                    (get(j) - m).exp() / sum
                }
            })
            .collect()
    });
    Buf::F64(scatter_lines(ls, parts)).store(out, x.shape())
}

pub fn topk(ctx: &Ctx, k: usize, dim: usize, largest: bool) -> Result<Vec<Tensor>> {
    let x = ctx.input(0)?;
    let parts = split3(ctx, x.shape(), dim)?;
    if k > parts.1 {
        return Err(ctx.invalid(format!(
            "k = {k} exceeds the size {} of dim {dim} of shape {:?}",
            parts.1,
            x.shape()
        )));
    }
    let mut oshape = x.shape().to_vec();
    if let Some(d) = oshape.get_mut(dim) {
        *d = k;
    }
    let kparts = (parts.0, k, parts.2);
    let (values, idx) = with_ordered!(x, v => {
        #[allow(clippy::eq_op)]
        let nan = |x: &_| x != x;
        let ls = lines(&v, parts, |get| {
            let mut order: Vec<usize> = (0..parts.1).collect();
            // NaN is the largest value; the stable sort keeps lower indices first among ties
            order.sort_by(|&a, &b| {
                let (va, vb) = (get(a), get(b));
                let ord = match (nan(&va), nan(&vb)) {
                    (true, true) => std::cmp::Ordering::Equal,
                    (true, false) => std::cmp::Ordering::Greater,
                    (false, true) => std::cmp::Ordering::Less,
                    _ => va.partial_cmp(&vb).unwrap_or(std::cmp::Ordering::Equal),
                };
                if largest { ord.reverse() } else { ord }
            });
            order.truncate(k);
            order.into_iter().map(|j| (get(j), j as i64)).collect::<Vec<_>>()
        });
        let vals = scatter_lines(ls.iter().map(|l| l.iter().map(|p| p.0).collect()).collect(), kparts);
        let idx = scatter_lines(ls.iter().map(|l| l.iter().map(|p| p.1).collect()).collect(), kparts);
        (Elem::wrap(vals), idx)
    });
    Ok(vec![
        values.store(ctx.out_dtype(0)?, &oshape)?,
        Buf::I64(idx).store(ctx.out_dtype(1)?, &oshape)?,
    ])
}

// PyTorch's printed values are kept verbatim in the tests
#[cfg(test)]
#[allow(clippy::excessive_precision)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{DType, ErrorKind, Op, ReduceOp, Tensor};

    fn red(
        op: ReduceOp,
        dims: &[usize],
        keepdim: bool,
        x: &Tensor,
        out: DType,
        shape: &[usize],
    ) -> Tensor {
        run1(
            Op::Reduce {
                op,
                dims: dims.to_vec(),
                keepdim,
            },
            &[x],
            out,
            shape,
        )
        .unwrap()
    }

    #[test]
    fn reductions_over_dims() {
        let x = f32t(&[2, 3], &[1.0, 5.0, 2.0, -1.0, 0.5, 8.0]);
        assert_eq!(
            red(ReduceOp::Sum, &[1], false, &x, DType::F32, &[2]).to_f32_vec(),
            vec![8.0, 7.5]
        );
        assert_eq!(
            red(ReduceOp::Max, &[0], true, &x, DType::F32, &[1, 3]).to_f32_vec(),
            vec![1.0, 5.0, 8.0]
        );
        assert_eq!(
            red(ReduceOp::Mean, &[], false, &x, DType::F32, &[]).to_f32_vec(),
            vec![15.5 / 6.0]
        );
        assert_eq!(
            red(ReduceOp::Prod, &[0, 1], false, &x, DType::F32, &[]).to_f32_vec(),
            vec![-40.0]
        );
        // sum of int32 gives int64, exactly
        let i = Tensor::from_i64(DType::I32, &[3], &[i32::MAX as i64, i32::MAX as i64, 1]).unwrap();
        assert_eq!(
            red(ReduceOp::Sum, &[0], false, &i, DType::I64, &[]).to_i64_vec(),
            vec![2 * i32::MAX as i64 + 1]
        );
        let b = Tensor::from_i64(DType::Bool, &[2, 2], &[1, 0, 1, 1]).unwrap();
        assert_eq!(
            red(ReduceOp::All, &[1], false, &b, DType::Bool, &[2]).to_i64_vec(),
            vec![0, 1]
        );
        assert_eq!(
            red(ReduceOp::Any, &[0], false, &b, DType::Bool, &[2]).to_i64_vec(),
            vec![1, 1]
        );
        let nan = f32t(&[2], &[3.0, f32::NAN]);
        assert!(red(ReduceOp::Min, &[0], false, &nan, DType::F32, &[]).to_f32_vec()[0].is_nan());
        let e = run1(
            Op::Reduce {
                op: ReduceOp::Sum,
                dims: vec![2],
                keepdim: false,
            },
            &[&x],
            DType::F32,
            &[2],
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn var_and_log_softmax_match_pytorch() {
        let x = f32t(&[2, 3, 4], &ramp(24, 11, 7));
        // torch.var(x, dim=(0, 2), correction=1, keepdim=True), PyTorch 2.15
        let v = run1(
            Op::Var {
                dims: vec![0, 2],
                correction: 1.0,
                keepdim: true,
            },
            &[&x],
            DType::F32,
            &[1, 3, 1],
        )
        .unwrap();
        close(&v.to_f32_vec(), &[0.78125, 0.59709823, 0.73214287], 1e-6);
        let s = run1(
            Op::Softmax { dim: 1, log: true },
            &[&x],
            DType::F32,
            &[2, 3, 4],
        )
        .unwrap();
        close(
            &s.to_f32_vec()[..8],
            &[
                -1.9118679,
                -0.94411218,
                -1.9118679,
                -0.31378084,
                -0.41186789,
                -2.1941123,
                -0.41186789,
                -1.5637808,
            ],
            1e-6,
        );
        let s = run1(
            Op::Softmax { dim: 0, log: false },
            &[&f32t(&[2], &[1000.0, 1000.0])],
            DType::F32,
            &[2],
        )
        .unwrap();
        assert_eq!(s.to_f32_vec(), vec![0.5, 0.5]);
    }

    #[test]
    fn arg_and_indexed_reductions_take_first_occurrence() {
        let x = f32t(&[2, 3], &[1.0, 5.0, 5.0, 7.0, -1.0, 7.0]);
        let a = run1(
            Op::ArgReduce {
                max: true,
                dim: Some(1),
                keepdim: false,
            },
            &[&x],
            DType::I64,
            &[2],
        )
        .unwrap();
        assert_eq!(a.to_i64_vec(), vec![1, 0]);
        let a = run1(
            Op::ArgReduce {
                max: false,
                dim: None,
                keepdim: true,
            },
            &[&x],
            DType::I64,
            &[1, 1],
        )
        .unwrap();
        assert_eq!(a.to_i64_vec(), vec![4]);
        // NaN counts as the max: torch.tensor([1.5, nan, 3.0]).argmax() == 1
        let n = f32t(&[3], &[1.5, f32::NAN, 3.0]);
        assert_eq!(
            run1(
                Op::ArgReduce {
                    max: true,
                    dim: None,
                    keepdim: false
                },
                &[&n],
                DType::I64,
                &[]
            )
            .unwrap()
            .to_i64_vec(),
            vec![1]
        );
        let op = Op::ReduceWithIndices {
            max: false,
            dim: 0,
            keepdim: true,
        };
        let r = crate::execute(
            &op,
            &[Some(&x)],
            &[(DType::F32, vec![1, 3]), (DType::I64, vec![1, 3])],
        )
        .unwrap();
        assert_eq!(r[0].to_f32_vec(), vec![1.0, -1.0, 5.0]);
        assert_eq!(r[1].to_i64_vec(), vec![0, 1, 0]);
    }

    #[test]
    fn cumsum_and_topk() {
        let i = Tensor::from_i64(DType::I32, &[2, 2], &[1, 2, 3, 4]).unwrap();
        let c = run1(Op::CumSum { dim: 0 }, &[&i], DType::I64, &[2, 2]).unwrap();
        assert_eq!(c.to_i64_vec(), vec![1, 2, 4, 6]);
        // torch.topk([[1,3,3,2],[nan,0,5,5]], 3, dim=1): values [[3,3,2],[nan,5,5]], indices [[1,2,3],[0,2,3]]
        let x = f32t(&[2, 4], &[1.0, 3.0, 3.0, 2.0, f32::NAN, 0.0, 5.0, 5.0]);
        let op = Op::TopK {
            k: 3,
            dim: 1,
            largest: true,
            sorted: true,
        };
        let r = crate::execute(
            &op,
            &[Some(&x)],
            &[(DType::F32, vec![2, 3]), (DType::I64, vec![2, 3])],
        )
        .unwrap();
        let v = r[0].to_f32_vec();
        assert_eq!(
            (&v[..3], v[3].is_nan(), &v[4..]),
            (&[3.0, 3.0, 2.0][..], true, &[5.0, 5.0][..])
        );
        assert_eq!(r[1].to_i64_vec(), vec![1, 2, 3, 0, 2, 3]);
        let op = Op::TopK {
            k: 2,
            dim: 0,
            largest: false,
            sorted: true,
        };
        let col = i64t(&[3, 1], &[4, -2, 9]);
        let r = crate::execute(
            &op,
            &[Some(&col)],
            &[(DType::I64, vec![2, 1]), (DType::I64, vec![2, 1])],
        )
        .unwrap();
        assert_eq!(
            (r[0].to_i64_vec(), r[1].to_i64_vec()),
            (vec![-2, 4], vec![1, 0])
        );
        let op = Op::TopK {
            k: 5,
            dim: 1,
            largest: true,
            sorted: true,
        };
        assert!(crate::execute(
            &op,
            &[Some(&x)],
            &[(DType::F32, vec![2, 5]), (DType::I64, vec![2, 5])]
        )
        .is_err());
    }
}
