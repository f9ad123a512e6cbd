//! Layout, indexing and creation: views, slices, cat, pads, gathers and
//! scatters, `full` and `arange`.

use etmetal_core::shape::{broadcast_shapes, numel};
use etmetal_core::{DType, Error, Op, Result};

use super::common::*;
use crate::ir::ValueInfo;

/// `(dtype, shape)` of each output of `op`, a layout, indexing or creation op.
pub(super) fn infer(op: &Op, inputs: &[Option<&ValueInfo>]) -> Result<Out> {
    match op {
        Op::Embedding => {
            let (w, idx) = (req(inputs, 0, "weight")?, req(inputs, 1, "indices")?);
            check_index_dtype(idx, "embedding indices")?;
            if w.shape.len() != 2 {
                return Err(Error::shape(format!(
                    "embedding weight must be 2-D, got {:?}",
                    w.shape
                )));
            }
            let mut shape = idx.shape.clone();
            shape.push(w.shape[1]);
            Ok(vec![(w.dtype, shape)])
        }
        Op::Reshape { shape } => {
            let x = first(inputs)?;
            if numel(&x.shape)? != numel(shape)? {
                return Err(Error::shape(format!(
                    "cannot reshape {:?} to {shape:?}",
                    x.shape
                )));
            }
            Ok(vec![(x.dtype, shape.clone())])
        }
        Op::Permute { dims } => {
            let x = first(inputs)?;
            let mut seen = vec![false; x.shape.len()];
            if dims.len() != x.shape.len()
                || dims
                    .iter()
                    .any(|&d| d >= seen.len() || std::mem::replace(&mut seen[d], true))
            {
                return Err(Error::shape(format!(
                    "{dims:?} is not a permutation of the dims of {:?}",
                    x.shape
                )));
            }
            Ok(vec![(x.dtype, dims.iter().map(|&d| x.shape[d]).collect())])
        }
        Op::Expand { shape } => {
            let x = first(inputs)?;
            let ok = shape.len() >= x.shape.len()
                && x.shape
                    .iter()
                    .rev()
                    .zip(shape.iter().rev())
                    .all(|(&a, &b)| a == b || a == 1);
            if !ok {
                return Err(Error::shape(format!(
                    "cannot expand {:?} to {shape:?}",
                    x.shape
                )));
            }
            Ok(vec![(x.dtype, shape.clone())])
        }
        Op::Slice {
            dim,
            start,
            end,
            step,
        } => {
            let x = first(inputs)?;
            check_dim(&x.shape, *dim, "slice")?;
            if *step == 0 || start > end || *end > x.shape[*dim] {
                return Err(Error::shape(format!(
                    "slice {start}..{end} step {step} of dim {dim} of {:?}",
                    x.shape
                )));
            }
            let mut shape = x.shape.clone();
            shape[*dim] = (end - start).div_ceil(*step);
            Ok(vec![(x.dtype, shape)])
        }
        Op::Select { dim, index } => {
            let x = first(inputs)?;
            check_dim(&x.shape, *dim, "select")?;
            if *index >= x.shape[*dim] {
                return Err(Error::shape(format!(
                    "select index {index} out of range for dim {dim} of {:?}",
                    x.shape
                )));
            }
            let mut shape = x.shape.clone();
            shape.remove(*dim);
            Ok(vec![(x.dtype, shape)])
        }
        Op::Cat { dim } => {
            let parts: Vec<&ValueInfo> = inputs.iter().copied().flatten().collect();
            let Some(first) = parts.iter().find(|p| p.shape != [0]) else {
                return Err(Error::shape("cat of no non-empty tensors"));
            };
            check_dim(&first.shape, *dim, "cat")?;
            let mut shape = first.shape.clone();
            shape[*dim] = 0;
            let mut dtype = parts[0].dtype;
            for p in &parts {
                dtype = DType::promote(dtype, p.dtype);
                if p.shape == [0] {
                    continue; // legacy empty tensors are skipped by torch.cat
                }
                let fits = p.shape.len() == shape.len()
                    && p.shape
                        .iter()
                        .zip(&first.shape)
                        .enumerate()
                        .all(|(i, (a, b))| i == *dim || a == b);
                if !fits {
                    return Err(Error::shape(format!(
                        "cat along dim {dim} of {:?} and {:?}",
                        first.shape, p.shape
                    )));
                }
                shape[*dim] += p.shape[*dim];
            }
            Ok(vec![(dtype, shape)])
        }
        Op::ConstantPad { pad, .. } => {
            let x = first(inputs)?;
            if pad.len() % 2 != 0 || pad.len() / 2 > x.shape.len() {
                return Err(Error::shape(format!("pad {pad:?} for shape {:?}", x.shape)));
            }
            let mut shape = x.shape.clone();
            for (i, pair) in pad.chunks(2).enumerate() {
                let d = shape.len() - 1 - i;
                let n = shape[d] as i64 + pair[0] + pair[1];
                if n < 0 {
                    return Err(Error::shape(format!(
                        "pad {pad:?} makes dim {d} of {:?} negative",
                        x.shape
                    )));
                }
                shape[d] = n as usize;
            }
            Ok(vec![(x.dtype, shape)])
        }
        Op::IndexSelect { dim } => {
            let (x, idx) = (first(inputs)?, req(inputs, 1, "index")?);
            check_index_dtype(idx, "index_select index")?;
            if idx.shape.len() > 1 {
                return Err(Error::shape(format!(
                    "index_select index must be 1-D, got {:?}",
                    idx.shape
                )));
            }
            let mut shape = x.shape.clone();
            if !shape.is_empty() {
                check_dim(&shape, *dim, "index_select")?;
                shape[*dim] = numel(&idx.shape)?;
            }
            Ok(vec![(x.dtype, shape)])
        }
        Op::Gather { dim } => {
            let (x, idx) = (first(inputs)?, req(inputs, 1, "index")?);
            check_index_dtype(idx, "gather index")?;
            if idx.shape.len() != x.shape.len() {
                return Err(Error::shape(format!(
                    "gather index {:?} must have the rank of {:?}",
                    idx.shape, x.shape
                )));
            }
            if !x.shape.is_empty() {
                check_dim(&x.shape, *dim, "gather")?;
            }
            Ok(vec![(x.dtype, idx.shape.clone())])
        }
        Op::IndexCopy { dim } => {
            let (x, idx, src) = (
                first(inputs)?,
                req(inputs, 1, "index")?,
                req(inputs, 2, "source")?,
            );
            check_index_dtype(idx, "index_copy index")?;
            check_dim(&x.shape, *dim, "index_copy")?;
            let mut rows = x.shape.clone();
            rows[*dim] = numel(&idx.shape)?;
            if idx.shape.len() > 1 || src.shape != rows || src.dtype != x.dtype {
                return Err(Error::shape(format!(
                    "index_copy of a {} source {:?} at an index {:?} into dim {dim} of {} {:?} \
                     (the source needs {rows:?})",
                    src.dtype, src.shape, idx.shape, x.dtype, x.shape
                )));
            }
            Ok(vec![(x.dtype, x.shape.clone())])
        }
        Op::Index => {
            let x = first(inputs)?;
            let slots = &inputs[1..];
            if slots.len() > x.shape.len() {
                return Err(Error::shape(format!(
                    "{} indices for a tensor of shape {:?}",
                    slots.len(),
                    x.shape
                )));
            }
            let mut bshape: Vec<usize> = vec![];
            let mut positions = vec![];
            for (d, s) in slots.iter().enumerate() {
                if let Some(i) = s {
                    if i.dtype == DType::Bool || i.dtype == DType::U8 {
                        return Err(Error::unsupported(
                            "boolean mask indexing (its shape depends on the data)",
                        ));
                    }
                    check_index_dtype(i, "index")?;
                    bshape = broadcast_shapes(&bshape, &i.shape)?;
                    positions.push(d);
                }
            }
            if positions.is_empty() {
                return same(x);
            }
            let adjacent = positions.windows(2).all(|w| w[1] == w[0] + 1);
            let rest = |range: std::ops::Range<usize>| {
                range.filter(|d| !positions.contains(d)).map(|d| x.shape[d])
            };
            let shape: Vec<usize> = if adjacent {
                rest(0..positions[0])
                    .chain(bshape)
                    .chain(rest(positions[0]..x.shape.len()))
                    .collect()
            } else {
                bshape.into_iter().chain(rest(0..x.shape.len())).collect()
            };
            Ok(vec![(x.dtype, shape)])
        }
        Op::Triangle { .. } => {
            let x = first(inputs)?;
            if x.shape.len() < 2 {
                return Err(Error::shape(format!(
                    "triu/tril needs rank >= 2, got {:?}",
                    x.shape
                )));
            }
            same(x)
        }
        Op::Repeat { repeats } => {
            let x = first(inputs)?;
            if repeats.len() < x.shape.len() {
                return Err(Error::shape(format!(
                    "repeat {repeats:?} has fewer dims than {:?}",
                    x.shape
                )));
            }
            let pad = repeats.len() - x.shape.len();
            let shape = repeats
                .iter()
                .enumerate()
                .map(|(i, &r)| r * if i < pad { 1 } else { x.shape[i - pad] })
                .collect();
            Ok(vec![(x.dtype, shape)])
        }
        Op::Full { shape, dtype, .. } => Ok(vec![(*dtype, shape.clone())]),
        Op::Arange {
            start,
            end,
            step,
            dtype,
        } => {
            let (s, e, st) = (start.to_f64(), end.to_f64(), step.to_f64());
            if st == 0.0 || !((e - s) / st).is_finite() {
                return Err(Error::shape(format!("arange({s}, {e}, {st})")));
            }
            Ok(vec![(
                *dtype,
                vec![((e - s) / st).ceil().max(0.0) as usize],
            )])
        }
        _ => Err(not_in_family(op, "a layout, indexing or creation op")),
    }
}
