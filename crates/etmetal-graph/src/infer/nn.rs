//! Neural-network ops: norms, matrix products, convolution, pooling and
//! attention.

use etmetal_core::shape::{attention_batch, broadcast_shapes};
use etmetal_core::{DType, Error, Op, Result};

use super::common::*;
use crate::ir::ValueInfo;

/// `(dtype, shape)` of each output of `op`, a norm, product, convolution, pool or attention.
pub(super) fn infer(op: &Op, inputs: &[Option<&ValueInfo>]) -> Result<Out> {
    match op {
        Op::LayerNorm {
            normalized_dims, ..
        }
        | Op::RmsNorm {
            normalized_dims, ..
        } => {
            let x = first(inputs)?;
            if *normalized_dims > x.shape.len() {
                return Err(Error::shape(format!(
                    "normalising {normalized_dims} dims of shape {:?}",
                    x.shape
                )));
            }
            let norm = &x.shape[x.shape.len() - normalized_dims..];
            for (slot, what) in [(1, "weight"), (2, "bias")] {
                if let Some(p) = inputs.get(slot).copied().flatten() {
                    if p.shape != norm {
                        return Err(Error::shape(format!(
                            "{what} shape {:?} != normalized shape {norm:?}",
                            p.shape
                        )));
                    }
                }
            }
            same(x)
        }
        Op::BatchNorm { .. } | Op::GroupNorm { .. } => {
            let x = first(inputs)?;
            if x.shape.len() < 2 {
                return Err(Error::shape(format!(
                    "normalisation over channels needs rank >= 2, got {:?}",
                    x.shape
                )));
            }
            let c = x.shape[1];
            if let Op::GroupNorm { groups, .. } = op {
                if *groups == 0 || c % groups != 0 {
                    return Err(Error::shape(format!(
                        "{c} channels do not split into {groups} groups"
                    )));
                }
            }
            for (slot, p) in inputs.iter().enumerate().skip(1) {
                if let Some(p) = p {
                    if p.shape != [c] {
                        return Err(Error::shape(format!(
                            "parameter {slot} has shape {:?}, expected [{c}]",
                            p.shape
                        )));
                    }
                }
            }
            if matches!(op, Op::BatchNorm { .. }) {
                req(inputs, 3, "running_mean")?;
                req(inputs, 4, "running_var")?;
            }
            same(x)
        }
        Op::MatMul => {
            let (a, b) = (req(inputs, 0, "a")?, req(inputs, 1, "b")?);
            Ok(vec![(
                DType::promote(a.dtype, b.dtype),
                matmul_shape(&a.shape, &b.shape)?,
            )])
        }
        Op::Addmm { .. } => {
            let (bias, a, b) = (
                req(inputs, 0, "bias")?,
                req(inputs, 1, "mat1")?,
                req(inputs, 2, "mat2")?,
            );
            if a.shape.len() != 2 || b.shape.len() != 2 {
                return Err(Error::shape(format!(
                    "addmm needs 2-D matrices, got {:?} and {:?}",
                    a.shape, b.shape
                )));
            }
            let out = matmul_shape(&a.shape, &b.shape)?;
            if broadcast_shapes(&bias.shape, &out)? != out {
                return Err(Error::shape(format!(
                    "addmm bias {:?} does not broadcast to {out:?}",
                    bias.shape
                )));
            }
            Ok(vec![(DType::promote(a.dtype, b.dtype), out)])
        }
        Op::Linear => {
            let (x, w) = (first(inputs)?, req(inputs, 1, "weight")?);
            let (Some(&inner), [out_f, in_f]) = (x.shape.last(), w.shape.as_slice()) else {
                return Err(Error::shape(format!(
                    "linear of {:?} with weight {:?}",
                    x.shape, w.shape
                )));
            };
            if inner != *in_f {
                return Err(Error::shape(format!(
                    "linear input {:?} does not match weight {:?}",
                    x.shape, w.shape
                )));
            }
            if let Some(b) = inputs.get(2).copied().flatten() {
                if b.shape != [*out_f] {
                    return Err(Error::shape(format!(
                        "linear bias {:?}, expected [{out_f}]",
                        b.shape
                    )));
                }
            }
            let mut shape = x.shape.clone();
            *shape.last_mut().unwrap_or(&mut 0) = *out_f;
            Ok(vec![(x.dtype, shape)])
        }
        Op::Convolution(conv) => {
            let (x, w) = (first(inputs)?, req(inputs, 1, "weight")?);
            let spatial = w.shape.len().saturating_sub(2);
            if spatial == 0 {
                return Err(Error::shape(format!(
                    "convolution weight {:?} has no spatial dims",
                    w.shape
                )));
            }
            let (lead, dims) = spatial_split(x, spatial, "convolution")?;
            let cin = *lead.last().unwrap_or(&0);
            let groups = conv.groups;
            let (expect_cin, cout) = conv.channels(&w.shape);
            if cin != expect_cin || cout % groups.max(1) != 0 {
                return Err(Error::shape(format!(
                    "convolution input {:?} with weight {:?} and groups {groups}: channels do not match",
                    x.shape, w.shape
                )));
            }
            if let Some(b) = inputs.get(2).copied().flatten() {
                if b.shape != [cout] {
                    return Err(Error::shape(format!(
                        "convolution bias {:?}, expected [{cout}]",
                        b.shape
                    )));
                }
            }
            let mut shape: Vec<usize> = lead[..lead.len() - 1].to_vec();
            shape.push(cout);
            shape.extend(conv.output_spatial(dims, &w.shape[2..])?);
            Ok(vec![(x.dtype, shape)])
        }
        Op::MaxPool(pool) => {
            let x = first(inputs)?;
            let (lead, dims) = spatial_split(x, pool.spatial_rank(), "max pool")?;
            let shape = [lead, &pool.window()?.output_spatial(dims)?].concat();
            let mut out = vec![(x.dtype, shape.clone())];
            if pool.with_indices {
                out.push((DType::I64, shape));
            }
            Ok(out)
        }
        Op::AvgPool(pool) => {
            let x = first(inputs)?;
            let (lead, dims) = spatial_split(x, pool.spatial_rank(), "avg pool")?;
            let shape = [lead, &pool.window()?.output_spatial(dims)?].concat();
            Ok(vec![(x.dtype, shape)])
        }
        Op::AdaptiveAvgPool { output_size } => {
            let x = first(inputs)?;
            let (lead, _) = spatial_split(x, output_size.len(), "adaptive avg pool")?;
            let mut shape = lead.to_vec();
            shape.extend_from_slice(output_size);
            Ok(vec![(x.dtype, shape)])
        }
        Op::Sdpa { enable_gqa, .. } => {
            let (q, k, v) = (
                req(inputs, 0, "query")?,
                req(inputs, 1, "key")?,
                req(inputs, 2, "value")?,
            );
            let r = q.shape.len();
            if r < 2 || k.shape.len() != r || v.shape.len() != r {
                return Err(Error::shape(format!(
                    "attention q {:?}, k {:?}, v {:?}: ranks differ or < 2",
                    q.shape, k.shape, v.shape
                )));
            }
            let (l, e, s, ev) = (
                q.shape[r - 2],
                q.shape[r - 1],
                k.shape[r - 2],
                v.shape[r - 1],
            );
            if k.shape[r - 1] != e || v.shape[r - 2] != s {
                return Err(Error::shape(format!(
                    "attention q {:?}, k {:?}, v {:?}: sizes differ",
                    q.shape, k.shape, v.shape
                )));
            }
            let mut batch = attention_batch(
                &q.shape[..r - 2],
                &k.shape[..r - 2],
                &v.shape[..r - 2],
                *enable_gqa,
            )
            .map_err(|e| {
                Error::shape(format!(
                    "attention batch dims of q {:?}, k {:?} and v {:?}: {}",
                    q.shape,
                    k.shape,
                    v.shape,
                    e.message()
                ))
            })?
            .batch;
            if let Some(m) = inputs.get(3).copied().flatten() {
                let mut scores = batch.clone();
                scores.extend([l, s]);
                if broadcast_shapes(&m.shape, &scores)? != scores {
                    return Err(Error::shape(format!(
                        "attention mask {:?} does not broadcast to {scores:?}",
                        m.shape
                    )));
                }
            }
            batch.extend([l, ev]);
            Ok(vec![(q.dtype, batch)])
        }
        _ => Err(not_in_family(
            op,
            "a norm, product, convolution, pool or attention",
        )),
    }
}
