//! Reductions along dims: sums and means, variance, arg max/min, cumsum,
//! softmax, top-k.

use etmetal_core::{DType, Error, Op, ReduceOp, Result};

use super::common::*;
use crate::ir::ValueInfo;

/// `(dtype, shape)` of each output of `op`, a reduction.
pub(super) fn infer(op: &Op, inputs: &[Option<&ValueInfo>]) -> Result<Out> {
    match op {
        Op::Reduce { op, dims, keepdim } => {
            let x = first(inputs)?;
            let dtype = match op {
                ReduceOp::Sum | ReduceOp::Prod if !x.dtype.is_float() => DType::I64,
                ReduceOp::Mean if !x.dtype.is_float() => {
                    return Err(Error::shape(format!(
                        "mean of a {} tensor (needs a float dtype)",
                        x.dtype
                    )))
                }
                ReduceOp::Any | ReduceOp::All => DType::Bool,
                _ => x.dtype,
            };
            Ok(vec![(dtype, reduced(&x.shape, dims, *keepdim)?)])
        }
        Op::Var { dims, keepdim, .. } => {
            let x = first(inputs)?;
            Ok(vec![(
                float_of(x.dtype),
                reduced(&x.shape, dims, *keepdim)?,
            )])
        }
        Op::ArgReduce { dim, keepdim, .. } => {
            let x = first(inputs)?;
            let shape = match dim {
                Some(d) => reduced(&x.shape, &[*d], *keepdim)?,
                None if *keepdim => vec![1; x.shape.len()],
                None => vec![],
            };
            Ok(vec![(DType::I64, shape)])
        }
        Op::ReduceWithIndices { dim, keepdim, .. } => {
            let x = first(inputs)?;
            let shape = reduced(&x.shape, &[*dim], *keepdim)?;
            Ok(vec![(x.dtype, shape.clone()), (DType::I64, shape)])
        }
        Op::CumSum { dim } => {
            let x = first(inputs)?;
            check_dim(&x.shape, *dim, "cumsum").or_else(|e| {
                if x.shape.is_empty() {
                    Ok(())
                } else {
                    Err(e)
                }
            })?;
            Ok(vec![(
                if x.dtype.is_float() {
                    x.dtype
                } else {
                    DType::I64
                },
                x.shape.clone(),
            )])
        }
        Op::Softmax { dim, .. } => {
            let x = first(inputs)?;
            if !x.shape.is_empty() {
                check_dim(&x.shape, *dim, "softmax")?;
            }
            Ok(vec![(float_of(x.dtype), x.shape.clone())])
        }
        Op::TopK { k, dim, .. } => {
            let x = first(inputs)?;
            let mut shape = x.shape.clone();
            if !shape.is_empty() {
                check_dim(&shape, *dim, "topk")?;
                if *k > shape[*dim] {
                    return Err(Error::shape(format!(
                        "topk k={k} exceeds size {} of dim {dim}",
                        shape[*dim]
                    )));
                }
                shape[*dim] = *k;
            }
            Ok(vec![(x.dtype, shape.clone()), (DType::I64, shape)])
        }
        _ => Err(not_in_family(op, "a reduction")),
    }
}
