//! Elementwise lowerings composed of the binary ops: `fmax`/`fmin`
//! (NaN-ignoring) and `clamp` with tensor bounds.

use etmetal_core::{BinaryOp, Op, Result};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

impl Lowerer<'_> {
    fn is_nan(&mut self, c: &Ctx, x: ValueId) -> Result<ValueId> {
        self.emit1(c, Op::Binary(BinaryOp::Ne), vec![Some(x), Some(x)])
    }

    /// `fmax(a, b)`: the larger, or the other operand where one is NaN:
    /// `where(isnan(b), a, where(isnan(a), b, maximum(a, b)))`.
    pub(super) fn fmax(&mut self, c: &Ctx, max: bool) -> Result<()> {
        let a = self.t(c, "self")?;
        let b = self.t(c, "other")?;
        let op = if max {
            BinaryOp::Maximum
        } else {
            BinaryOp::Minimum
        };
        let m = self.emit1(c, Op::Binary(op), vec![Some(a), Some(b)])?;
        let a_nan = self.is_nan(c, a)?;
        let m = self.emit1(c, Op::Where, vec![Some(a_nan), Some(b), Some(m)])?;
        let b_nan = self.is_nan(c, b)?;
        self.finish(c, Op::Where, vec![Some(b_nan), Some(a), Some(m)])
    }

    /// `clamp(x, min, max)` with tensor bounds: `minimum(maximum(x, min), max)`
    /// (a `max` below `min` wins, as in PyTorch).
    pub(super) fn clamp_tensor(&mut self, c: &Ctx) -> Result<()> {
        let x = self.t(c, "self")?;
        let lo = self.opt_t(c, "min")?;
        let hi = self.opt_t(c, "max")?;
        let mut v = x;
        for (bound, op) in [(lo, BinaryOp::Maximum), (hi, BinaryOp::Minimum)] {
            if let Some(b) = bound {
                v = self.emit1(c, Op::Binary(op), vec![Some(v), Some(b)])?;
            }
        }
        self.bind_or_copy(c, x, v)
    }
}
