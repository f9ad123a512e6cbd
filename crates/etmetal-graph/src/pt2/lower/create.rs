//! Tensors made from sizes and scalars: `full` and its `*_like` and
//! `new_*` forms, `fill`, `scalar_tensor`, `arange`.

use etmetal_core::{DType, Op, Result, Scalar};

use super::{Ctx, Lowerer};

impl Lowerer<'_> {
    /// Lower `c` (ATen op `name`, overload `overload`) if it is a tensor made from sizes and scalars (`full`, `arange`, …);
    /// `false` when it is not.
    pub(super) fn lower_creation(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let a = &c.args;
        let lowered = match (name, overload) {
            ("fill", "Scalar" | "Tensor") | ("zero", "default") => {
                let x = self.t(c, "self")?;
                let (shape, dtype) = (self.shape(x), self.dtype(x));
                if a.is_tensor("value")? {
                    let v = self.t(c, "value")?;
                    let v = self.broadcast_to(c, v, &shape, dtype)?;
                    return self.finish(c, Op::Identity, vec![Some(v)]).map(|()| true);
                }
                let value = match name {
                    "zero" => Scalar::Int(0),
                    _ => self.req_scalar(c, "value")?,
                };
                self.finish(
                    c,
                    Op::Full {
                        shape,
                        value,
                        dtype,
                    },
                    vec![],
                )
            }
            ("full", "default") => {
                let shape = self.size_arg(c, "size")?;
                let v = self.req_scalar(c, "fill_value")?;
                self.full(c, shape, v, v.dtype())
            }
            ("zeros" | "ones" | "empty", "default" | "memory_format") => {
                let shape = self.size_arg(c, "size")?;
                self.full(c, shape, Scalar::Int((name == "ones") as i64), DType::F32)
            }
            ("full_like" | "zeros_like" | "ones_like" | "empty_like", "default") => {
                let x = self.t(c, "self")?;
                let v = match name {
                    "full_like" => self.req_scalar(c, "fill_value")?,
                    "ones_like" => Scalar::Int(1),
                    _ => Scalar::Int(0),
                };
                let (shape, dtype) = (self.shape(x), self.dtype(x));
                self.full(c, shape, v, dtype)
            }
            ("new_zeros" | "new_ones" | "new_full" | "new_empty", "default") => {
                let x = self.t(c, "self")?;
                let shape = self.size_arg(c, "size")?;
                let v = match name {
                    "new_full" => self.req_scalar(c, "fill_value")?,
                    "new_ones" => Scalar::Int(1),
                    _ => Scalar::Int(0),
                };
                let dtype = self.dtype(x);
                self.full(c, shape, v, dtype)
            }
            ("scalar_tensor", "default") => {
                let v = self.req_scalar(c, "s")?;
                self.full(c, vec![], v, DType::F32)
            }
            ("arange", "default" | "start" | "start_step") => {
                let start = a.scalar("start")?.unwrap_or(Scalar::Int(0));
                let end = self.req_scalar(c, "end")?;
                let step = a.scalar("step")?.unwrap_or(Scalar::Int(1));
                let all_int = [start, end, step]
                    .iter()
                    .all(|s| matches!(s, Scalar::Int(_)));
                let dtype = a.scalar_type("dtype")?.unwrap_or(if all_int {
                    DType::I64
                } else {
                    DType::F32
                });
                self.finish(
                    c,
                    Op::Arange {
                        start,
                        end,
                        step,
                        dtype,
                    },
                    vec![],
                )
            }
            _ => return Ok(false),
        };
        lowered.map(|()| true)
    }
}
