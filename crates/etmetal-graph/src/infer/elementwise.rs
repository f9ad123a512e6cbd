//! Elementwise ops: unary and binary functions (with PyTorch's type
//! promotion), `where`, casts and copies.

use etmetal_core::shape::broadcast_shapes;
use etmetal_core::{BinaryOp, DType, Error, Op, Result, UnaryOp};

use super::common::*;
use crate::ir::ValueInfo;

/// `(dtype, shape)` of each output of `op`, an elementwise op.
pub(super) fn infer(op: &Op, inputs: &[Option<&ValueInfo>]) -> Result<Out> {
    match op {
        Op::Unary(u) => {
            let x = first(inputs)?;
            let dtype = match u {
                u if u.is_predicate() => DType::Bool,
                u if u.is_bitwise() => x.dtype,
                UnaryOp::Relu
                | UnaryOp::Neg
                | UnaryOp::Abs
                | UnaryOp::Sign
                | UnaryOp::Clamp { .. } => x.dtype,
                UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round => x.dtype,
                UnaryOp::PowScalar { exponent }
                    if !x.dtype.is_float() && exponent.fract() == 0.0 =>
                {
                    x.dtype
                }
                _ => float_of(x.dtype),
            };
            Ok(vec![(dtype, x.shape.clone())])
        }
        Op::Binary(b) => {
            let (l, r) = (req(inputs, 0, "lhs")?, req(inputs, 1, "rhs")?);
            let shape = broadcast_shapes(&l.shape, &r.shape)?;
            let common = result_type(l, r);
            let dtype = match b {
                b if b.is_predicate() => DType::Bool,
                BinaryOp::Div => float_of(common),
                b if b.is_bitwise() && common.is_float() => {
                    return Err(Error::shape(format!("bitwise op on {common} tensors")));
                }
                _ => common,
            };
            Ok(vec![(dtype, shape)])
        }
        Op::Where => {
            let (c, a, b) = (
                req(inputs, 0, "condition")?,
                req(inputs, 1, "self")?,
                req(inputs, 2, "other")?,
            );
            if c.dtype != DType::Bool {
                return Err(Error::shape(format!(
                    "where condition must be bool, got {}",
                    c.dtype
                )));
            }
            let shape = broadcast_shapes(&broadcast_shapes(&c.shape, &a.shape)?, &b.shape)?;
            Ok(vec![(result_type(a, b), shape)])
        }
        Op::Cast { dtype } => Ok(vec![(*dtype, first(inputs)?.shape.clone())]),
        Op::Identity => same(first(inputs)?),
        _ => Err(not_in_family(op, "an elementwise op")),
    }
}
