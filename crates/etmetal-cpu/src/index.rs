//! Indexing by tensors: index_select, gather, index_copy, advanced
//! indexing and embedding. Indices are checked against their dim; out-of-range values are
//! `InvalidInput` errors naming the op, the value and the bound.

use etmetal_core::shape::{broadcast_shapes, broadcast_strides, contiguous_strides, numel};
use etmetal_core::{Result, Tensor};

use crate::ctx::Ctx;
use crate::strided::{by_width, for_each_offset};

/// The integer indices in `slot`, each checked in `0..size` (negative values
/// count from the end when `wrap`).
fn indices(ctx: &Ctx, slot: usize, size: usize, wrap: bool) -> Result<Vec<usize>> {
    let t = ctx.input(slot)?;
    if !t.dtype().is_int() {
        let what = if t.dtype() == etmetal_core::DType::Bool {
            " (bool masks give data-dependent shapes)"
        } else {
            ""
        };
        return Err(ctx.unsupported(format!(
            "index slot {slot} has dtype {}, expected an integer dtype{what}",
            t.dtype()
        )));
    }
    t.to_i64_vec()
        .into_iter()
        .map(|i| {
            let j = if wrap && i < 0 { i + size as i64 } else { i };
            if j < 0 || j >= size as i64 {
                Err(ctx.invalid(format!(
                    "index {i} in slot {slot} is out of range for a dim of size {size}"
                )))
            } else {
                Ok(j as usize)
            }
        })
        .collect()
}

/// Copy element `src[s]` to each output position, `s` from `offsets`.
fn take(x: &Tensor, shape: &[usize], offsets: impl Iterator<Item = usize>) -> Result<Tensor> {
    by_width!(x.dtype(), T => {
        let src = x.values::<T>()?;
        let out: Vec<T> = offsets.map(|s| src[s]).collect();
        Tensor::from_slice(x.dtype(), shape, &out)
    })
}

/// Input 0's size along `dim` and the rows input 1 (0-D or 1-D) names
/// along it.
fn rows_along(ctx: &Ctx, dim: usize) -> Result<(usize, Vec<usize>)> {
    let x = ctx.input(0)?;
    let size = *x.shape().get(dim).ok_or_else(|| {
        ctx.invalid(format!(
            "dim {dim} is out of range for shape {:?}",
            x.shape()
        ))
    })?;
    if ctx.input(1)?.rank() > 1 {
        return Err(ctx.invalid(format!(
            "index must be 0-D or 1-D, got shape {:?}",
            ctx.input(1)?.shape()
        )));
    }
    Ok((size, indices(ctx, 1, size, false)?))
}

pub fn index_select(ctx: &Ctx, dim: usize) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let (size, idx) = rows_along(ctx, dim)?;
    let mut shape = x.shape().to_vec();
    shape[dim] = idx.len();
    let (outer, inner): (usize, usize) = (
        x.shape()[..dim].iter().product(),
        x.shape()[dim + 1..].iter().product(),
    );
    let offsets = (0..outer).flat_map(|o| {
        let idx = &idx;
        idx.iter()
            .flat_map(move |&i| (0..inner).map(move |k| (o * size + i) * inner + k))
    });
    take(x, &shape, offsets)
}

/// `index_copy`: `x` with row `index[m]` of `dim` replaced by row `m` of
/// the source (a repeated row takes the last).
pub fn index_copy(ctx: &Ctx, dim: usize) -> Result<Tensor> {
    let (x, src) = (ctx.input(0)?, ctx.input(2)?);
    let (size, idx) = rows_along(ctx, dim)?;
    let mut rows = x.shape().to_vec();
    rows[dim] = idx.len();
    if src.shape() != rows || src.dtype() != x.dtype() {
        return Err(ctx.invalid(format!(
            "source is {} {:?}, expected {} {rows:?}",
            src.dtype(),
            src.shape(),
            x.dtype()
        )));
    }
    let (outer, inner): (usize, usize) = (
        x.shape()[..dim].iter().product(),
        x.shape()[dim + 1..].iter().product(),
    );
    by_width!(x.dtype(), T => {
        let mut out = x.values::<T>()?.to_vec();
        let from = src.values::<T>()?;
        for o in 0..outer {
            for (m, &i) in idx.iter().enumerate() {
                let (d, f) = ((o * size + i) * inner, (o * idx.len() + m) * inner);
                out[d..d + inner].copy_from_slice(&from[f..f + inner]);
            }
        }
        Tensor::from_slice(x.dtype(), x.shape(), &out)
    })
}

pub fn gather(ctx: &Ctx, dim: usize) -> Result<Tensor> {
    let (x, index) = (ctx.input(0)?, ctx.input(1)?);
    let size = *x.shape().get(dim).ok_or_else(|| {
        ctx.invalid(format!(
            "dim {dim} is out of range for shape {:?}",
            x.shape()
        ))
    })?;
    let fits = index.rank() == x.rank()
        && (0..x.rank()).all(|d| d == dim || index.shape()[d] <= x.shape()[d]);
    if !fits {
        return Err(ctx.invalid(format!(
            "index of shape {:?} does not fit input {:?} outside dim {dim}",
            index.shape(),
            x.shape()
        )));
    }
    let idx = indices(ctx, 1, size, false)?;
    let mut xs = contiguous_strides(x.shape());
    let step = std::mem::replace(&mut xs[dim], 0);
    let mut offsets = Vec::with_capacity(idx.len());
    let mut k = 0;
    for_each_offset(index.shape(), [&xs], [0], |[o]| {
        offsets.push(o + idx[k] * step);
        k += 1;
    });
    take(x, index.shape(), offsets.into_iter())
}

pub fn embedding(ctx: &Ctx) -> Result<Tensor> {
    let (w, ids) = (ctx.input(0)?, ctx.input(1)?);
    if w.rank() != 2 {
        return Err(ctx.invalid(format!(
            "weight must be [num_embeddings, dim], got {:?}",
            w.shape()
        )));
    }
    let (v, d) = (w.shape()[0], w.shape()[1]);
    let idx = indices(ctx, 1, v, false)?;
    let mut shape = ids.shape().to_vec();
    shape.push(d);
    take(
        w,
        &shape,
        idx.into_iter().flat_map(|i| (0..d).map(move |k| i * d + k)),
    )
}

/// `x[i0, i1, …]`: index tensors broadcast together to shape B. When the
/// indexed dims are adjacent B takes their place; otherwise B comes first,
/// followed by the remaining dims (PyTorch's / NumPy's rule).
pub fn index(ctx: &Ctx) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let slots = ctx.inputs.len() - 1;
    if slots > x.rank() {
        return Err(ctx.invalid(format!("{slots} indices given for shape {:?}", x.shape())));
    }
    let indexed: Vec<usize> = (0..slots)
        .filter(|&d| ctx.optional(d + 1).is_some())
        .collect();
    let (Some(&first), Some(&last)) = (indexed.first(), indexed.last()) else {
        return Ok(x.clone());
    };
    let mut b = vec![];
    for &d in &indexed {
        b = broadcast_shapes(&b, ctx.input(d + 1)?.shape())
            .map_err(|e| ctx.invalid(format!("index tensors: {}", e.message())))?;
    }
    let xs = contiguous_strides(x.shape());
    // offset into x contributed by the indexed dims, per element of B
    let mut boff = vec![0usize; numel(&b)?];
    for &d in &indexed {
        let idx = indices(ctx, d + 1, x.shape()[d], true)?;
        let s = broadcast_strides(ctx.input(d + 1)?.shape(), &b);
        let mut k = 0;
        for_each_offset(&b, [&s], [0], |[i]| {
            boff[k] += idx[i] * xs[d];
            k += 1;
        });
    }
    let adjacent = last - first + 1 == indexed.len();
    let rest =
        |r: std::ops::Range<usize>| r.filter(|d| !indexed.contains(d)).collect::<Vec<usize>>();
    let (pre, post) = if adjacent {
        (rest(0..first), rest(first..x.rank()))
    } else {
        (vec![], rest(0..x.rank()))
    };
    let dims_of = |ds: &[usize]| ds.iter().map(|&d| x.shape()[d]).collect::<Vec<_>>();
    let strides_of = |ds: &[usize]| ds.iter().map(|&d| xs[d]).collect::<Vec<_>>();
    let offsets_of = |ds: &[usize]| {
        let mut v = vec![];
        for_each_offset(&dims_of(ds), [&strides_of(ds)], [0], |[o]| v.push(o));
        v
    };
    let (pre_off, post_off) = (offsets_of(&pre), offsets_of(&post));
    let shape: Vec<usize> = [dims_of(&pre), b, dims_of(&post)].concat();
    numel(&shape)?;
    let offsets = pre_off.iter().flat_map(|&p| {
        let post_off = &post_off;
        boff.iter()
            .flat_map(move |&q| post_off.iter().map(move |&r| p + q + r))
    });
    take(x, &shape, offsets)
}

#[cfg(test)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{DType, ErrorKind, Op, Tensor};

    fn x234() -> Tensor {
        i64t(&[2, 3, 4], &(0..24).collect::<Vec<_>>())
    }

    #[test]
    fn index_copy_replaces_the_named_rows() {
        let src = i64t(&[2, 2, 4], &(100..116).collect::<Vec<_>>());
        let at = i64t(&[2], &[2, 0]);
        let op = Op::IndexCopy { dim: 1 };
        let y = run1(op.clone(), &[&x234(), &at, &src], DType::I64, &[2, 3, 4]).unwrap();
        // torch.arange(24).reshape(2, 3, 4).index_copy(1, tensor([2, 0]), src)
        let want = [
            104, 105, 106, 107, 4, 5, 6, 7, 100, 101, 102, 103, //
            112, 113, 114, 115, 16, 17, 18, 19, 108, 109, 110, 111,
        ];
        assert_eq!(y.to_i64_vec(), want);
        let far = i64t(&[2], &[3, 0]);
        let e = run1(op, &[&x234(), &far, &src], DType::I64, &[2, 3, 4]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.to_string().contains("index 3"), "{e}");
    }

    #[test]
    fn index_select_gather_embedding() {
        let x = x234();
        let y = run1(
            Op::IndexSelect { dim: 1 },
            &[&x, &i64t(&[2], &[2, 0])],
            DType::I64,
            &[2, 2, 4],
        )
        .unwrap();
        assert_eq!(&y.to_i64_vec()[..8], &[8, 9, 10, 11, 0, 1, 2, 3]);
        let e = run1(
            Op::IndexSelect { dim: 1 },
            &[&x, &i64t(&[1], &[3])],
            DType::I64,
            &[2, 1, 4],
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(
            e.to_string().contains("index 3") && e.to_string().contains("size 3"),
            "{e}"
        );
        let m = i64t(&[2, 2], &[1, 2, 3, 4]);
        let g = run1(
            Op::Gather { dim: 1 },
            &[&m, &i64t(&[2, 3], &[0, 0, 1, 1, 0, 0])],
            DType::I64,
            &[2, 3],
        )
        .unwrap();
        assert_eq!(g.to_i64_vec(), vec![1, 1, 2, 4, 3, 3]);
        assert!(run1(
            Op::Gather { dim: 0 },
            &[&m, &i64t(&[1, 1], &[-1])],
            DType::I64,
            &[1, 1]
        )
        .is_err());
        let w = f32t(&[3, 2], &[0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        let ids = Tensor::from_i64(DType::I32, &[2, 1], &[2, 0]).unwrap();
        let y = run1(Op::Embedding, &[&w, &ids], DType::F32, &[2, 1, 2]).unwrap();
        assert_eq!(y.to_f32_vec(), vec![2.0, 2.5, 0.0, 0.5]);
        let e = run1(Op::Embedding, &[&w, &i64t(&[1], &[3])], DType::F32, &[1, 2]).unwrap_err();
        assert!(e.to_string().contains("index 3"), "{e}");
    }

    #[test]
    fn advanced_index_adjacent_and_not() {
        let x = x234();
        // x[:, tensor([2, 0]), tensor([1, 1])] == [[9, 1], [21, 13]] (PyTorch 2.15)
        let (i1, i2) = (i64t(&[2], &[2, 0]), i64t(&[2], &[1, 1]));
        let y = crate::execute(
            &Op::Index,
            &[Some(&x), None, Some(&i1), Some(&i2)],
            &[(DType::I64, vec![2, 2])],
        )
        .unwrap();
        assert_eq!(y[0].to_i64_vec(), vec![9, 1, 21, 13]);
        // x[tensor([[1], [0]]), :, tensor([0, 3, -1])]: broadcast dims first, shape [2, 3, 3]
        let (a, c) = (i64t(&[2, 1], &[1, 0]), i64t(&[3], &[0, 3, -1]));
        let y = crate::execute(
            &Op::Index,
            &[Some(&x), Some(&a), None, Some(&c)],
            &[(DType::I64, vec![2, 3, 3])],
        )
        .unwrap();
        assert_eq!(
            y[0].to_i64_vec(),
            vec![12, 16, 20, 15, 19, 23, 15, 19, 23, 0, 4, 8, 3, 7, 11, 3, 7, 11]
        );
        // trailing dims kept: x[tensor([1])] has shape [1, 3, 4]
        let y = crate::execute(
            &Op::Index,
            &[Some(&x), Some(&i64t(&[1], &[1]))],
            &[(DType::I64, vec![1, 3, 4])],
        )
        .unwrap();
        assert_eq!(y[0].to_i64_vec()[0], 12);
        let mask = Tensor::from_i64(DType::Bool, &[2], &[1, 0]).unwrap();
        let e = crate::execute(
            &Op::Index,
            &[Some(&x), Some(&mask)],
            &[(DType::I64, vec![1, 3, 4])],
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let e = crate::execute(
            &Op::Index,
            &[Some(&x), Some(&i64t(&[1], &[-3]))],
            &[(DType::I64, vec![1, 3, 4])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("index -3"), "{e}");
    }
}
