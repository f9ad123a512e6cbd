//! Elementwise lowerings composed of the binary ops: `fmax`/`fmin`
//! (NaN-ignoring) and `clamp` with tensor bounds.

use etmetal_core::op_table;
use etmetal_core::{BinaryOp, DType, Error, Op, Result, Scalar, UnaryOp};

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

impl Lowerer<'_> {
    /// Lower `c` (ATen op `name`, overload `overload`) if it is an elementwise op, a cast or a copy (the op table's unary and binary ops, and those with attributes);
    /// `false` when it is not.
    pub(super) fn lower_elementwise(
        &mut self,
        c: &Ctx,
        name: &str,
        overload: &str,
    ) -> Result<bool> {
        let a = &c.args;
        use BinaryOp as B;
        use UnaryOp as U;
        // `round.decimals` has an attribute; the rest of the table's unary
        // ops are their ATen op of any overload
        let unary = match (name, overload) {
            ("round", o) if o != "default" => None,
            _ => op_table::unary_of_aten(name),
        };
        if let Some(u) = unary {
            return self.unary(c, "self", u).map(|()| true);
        }
        let binary = match (name, overload) {
            ("div", _) => Some(match a.string("rounding_mode")? {
                None => B::Div,
                Some("floor") => B::FloorDiv,
                Some("trunc") => B::TruncDiv,
                Some(m) => return Err(Error::format(format!("unknown rounding_mode `{m}`"))),
            }),
            // a scalar exponent is `UnaryOp::PowScalar`, below
            ("pow", "Tensor_Scalar") => None,
            _ => op_table::binary_of_aten(name),
        };
        if let Some(b) = binary {
            // `pow.Scalar` has a scalar `self`; `binary` takes scalars on either side
            let rhs = if name == "pow" { "exponent" } else { "other" };
            return self.binary(c, b, "self", rhs).map(|()| true);
        }
        let lowered = match (name, overload) {
            ("rsub", _) => self.binary(c, B::Sub, "other", "self"),
            ("max" | "min", "other") => {
                let op = if name == "max" {
                    B::Maximum
                } else {
                    B::Minimum
                };
                self.binary(c, op, "self", "other")
            }
            ("fmax" | "fmin", "default") => self.fmax(c, name == "fmax"),
            ("clamp" | "clamp_min" | "clamp_max", "Tensor") => self.clamp_tensor(c),
            ("pow", "Tensor_Scalar") => {
                let exponent = self.req_scalar(c, "exponent")?.to_f64();
                self.unary(c, "self", U::PowScalar { exponent })
            }
            ("square", _) => self.unary(c, "self", U::PowScalar { exponent: 2.0 }),
            ("gelu", _) => {
                let tanh = match a.string("approximate")?.unwrap_or("none") {
                    "none" => false,
                    "tanh" => true,
                    m => return Err(Error::format(format!("unknown gelu approximation `{m}`"))),
                };
                self.unary(c, "self", U::Gelu { tanh })
            }
            ("leaky_relu", _) => {
                let slope = a.float("negative_slope", 0.01)?;
                self.unary(c, "self", U::LeakyRelu { slope })
            }
            ("relu6", _) => self.unary(
                c,
                "self",
                U::Clamp {
                    min: Some(0.0),
                    max: Some(6.0),
                },
            ),
            ("hardtanh", _) => {
                let (min, max) = (a.float("min_val", -1.0)?, a.float("max_val", 1.0)?);
                self.unary(
                    c,
                    "self",
                    U::Clamp {
                        min: Some(min),
                        max: Some(max),
                    },
                )
            }
            ("clamp", "default") | ("clamp_min", "default") | ("clamp_max", "default") => {
                let (min, max) = (a.opt_float("min")?, a.opt_float("max")?);
                self.unary(c, "self", U::Clamp { min, max })
            }
            ("where", "self" | "ScalarSelf" | "ScalarOther" | "Scalar") => {
                let cond = self.t(c, "condition")?;
                let (x, y) = if a.is_tensor("self")? {
                    let x = self.t(c, "self")?;
                    (x, self.operand(c, "other", Some(x))?)
                } else if a.is_tensor("other")? {
                    let y = self.t(c, "other")?;
                    (self.operand(c, "self", Some(y))?, y)
                } else {
                    (
                        self.operand(c, "self", None)?,
                        self.operand(c, "other", None)?,
                    )
                };
                self.finish(c, Op::Where, vec![Some(cond), Some(x), Some(y)])
            }
            ("masked_fill", "Scalar" | "Tensor") => {
                let x = self.t(c, "self")?;
                let mask = self.t(c, "mask")?;
                let dtype = self.dtype(x);
                // masked_fill keeps self's dtype whatever the value's
                let value = if a.is_tensor("value")? {
                    let v = self.t(c, "value")?;
                    if self.dtype(v) == dtype {
                        v
                    } else {
                        self.emit1(c, Op::Cast { dtype }, vec![Some(v)])?
                    }
                } else {
                    let s = self.req_scalar(c, "value")?;
                    self.constant(c, "value", s, dtype)?
                };
                self.finish(c, Op::Where, vec![Some(mask), Some(value), Some(x)])
            }
            // the device named is the exporting machine's: etmetal places
            // tensors itself, so a move is a copy and only the dtype counts
            ("_to_copy", "default")
            | ("to", "dtype" | "dtype_layout" | "device" | "other" | "prim_Device")
            | ("type_as", "default") => {
                if let Some(("as_layout", l)) = a.get("layout")? {
                    // torch.export's serde numbers `torch.strided` 7
                    if l.as_i64() != Some(7) {
                        return Err(Error::unsupported(format!(
                            "conversion to layout {l} (only dense, strided tensors)"
                        )));
                    }
                }
                let x = self.t(c, "self")?;
                let dtype = match a.scalar_type("dtype")? {
                    Some(d) => Some(d),
                    None => self.opt_t(c, "other")?.map(|o| self.dtype(o)),
                };
                match dtype {
                    Some(dtype) if dtype != self.dtype(x) => {
                        self.finish(c, Op::Cast { dtype }, vec![Some(x)])
                    }
                    _ => self.finish(c, Op::Identity, vec![Some(x)]),
                }
            }
            // range checks of SymInts: export proved them over the ranges
            (
                "_assert_tensor_metadata"
                | "_assert_scalar"
                | "sym_constrain_range"
                | "sym_constrain_range_for_size",
                _,
            ) => Ok(()),
            (
                "clone" | "contiguous" | "alias" | "alias_copy" | "detach" | "detach_"
                | "lift_fresh_copy",
                _,
            ) => self.unary_identity(c, "self"),
            (
                "dropout"
                | "feature_dropout"
                | "alpha_dropout"
                | "feature_alpha_dropout"
                | "native_dropout",
                "default",
            ) => {
                if a.bool("train", false)? && a.float("p", 0.0)? != 0.0 {
                    return Err(Error::unsupported(format!(
                        "{name} in training mode (p={}); export the model after \
                         `model.eval()`, where dropout is the identity",
                        a.float("p", 0.0)?
                    )));
                }
                // the in-place forms name their tensor `self`
                let arg = if a.is_tensor("input")? {
                    "input"
                } else {
                    "self"
                };
                let x = self.t(c, arg)?;
                let y = self.emit1(c, Op::Identity, vec![Some(x)])?;
                if name == "native_dropout" && self.is_used(c, 1) {
                    // the keep-mask of eval mode keeps everything
                    let full = Op::Full {
                        shape: self.shape(x),
                        value: Scalar::Bool(true),
                        dtype: DType::Bool,
                    };
                    let mask = self.emit1(c, full, vec![])?;
                    self.bind(c, 1, mask)?;
                }
                self.bind(c, 0, y)
            }
            _ => return Ok(false),
        };
        lowered.map(|()| true)
    }
}
