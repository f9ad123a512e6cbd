//! Reductions: sums, means and other reductions over dims, variance,
//! arg max/min, cumsum, softmax, top-k and sort.

use etmetal_core::shape::normalize_dim;
use etmetal_core::{Error, Op, ReduceOp, Result};

use super::{Ctx, Lowerer};

impl Lowerer<'_> {
    /// Lower `c` (ATen op `name`, overload `overload`) if it is a reduction, softmax, top-k or sort;
    /// `false` when it is not.
    pub(super) fn lower_reduction(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let a = &c.args;
        let lowered = match (name, overload) {
            ("sum", "dim_IntList" | "default") => self.reduce(c, ReduceOp::Sum, "dim"),
            ("mean", "dim" | "default") => self.reduce(c, ReduceOp::Mean, "dim"),
            ("prod", "dim_int" | "default") => self.reduce(c, ReduceOp::Prod, "dim"),
            ("amax", _) => self.reduce(c, ReduceOp::Max, "dim"),
            ("amin", _) => self.reduce(c, ReduceOp::Min, "dim"),
            ("max", "default") => self.reduce(c, ReduceOp::Max, "dim"),
            ("min", "default") => self.reduce(c, ReduceOp::Min, "dim"),
            ("any", "dim" | "dims" | "default") => self.reduce(c, ReduceOp::Any, "dim"),
            ("all", "dim" | "dims" | "default") => self.reduce(c, ReduceOp::All, "dim"),
            // a 0-d bool tensor's truth, read by `item` into runtime checks
            ("_is_all_true" | "_is_any_true", "default") => {
                let x = self.t(c, "self")?;
                let op = if name == "_is_all_true" {
                    ReduceOp::All
                } else {
                    ReduceOp::Any
                };
                let dims = (0..self.rank(x)).collect();
                self.finish(
                    c,
                    Op::Reduce {
                        op,
                        dims,
                        keepdim: false,
                    },
                    vec![Some(x)],
                )
            }
            ("var", "dim" | "correction" | "default") => self.variance(c, false),
            ("std", "dim" | "correction" | "default") => self.variance(c, true),
            ("argmax" | "argmin", _) => {
                let x = self.t(c, "self")?;
                let dim = a
                    .opt_int("dim")?
                    .map(|d| normalize_dim(d, self.rank(x)))
                    .transpose()?;
                let op = Op::ArgReduce {
                    max: name == "argmax",
                    dim,
                    keepdim: a.bool("keepdim", false)?,
                };
                self.finish(c, op, vec![Some(x)])
            }
            ("max" | "min", "dim") => {
                let x = self.t(c, "self")?;
                let dim = self.dim(c, "dim", 0, self.rank(x))?;
                let op = Op::ReduceWithIndices {
                    max: name == "max",
                    dim,
                    keepdim: a.bool("keepdim", false)?,
                };
                self.finish(c, op, vec![Some(x)])
            }
            ("cumsum", "default") => {
                let x = self.t(c, "self")?;
                let x = self.with_dtype(c, x)?;
                let dim = self.dim(c, "dim", 0, self.rank(x))?;
                let sum = self.emit1(c, Op::CumSum { dim }, vec![Some(x)])?;
                // CumSum widens ints to int64; `dtype` (int32 in MoE
                // routing's offsets) narrows it back
                match a.scalar_type("dtype")? {
                    Some(d) if d != self.dtype(sum) => {
                        self.finish(c, Op::Cast { dtype: d }, vec![Some(sum)])
                    }
                    _ => self.bind(c, 0, sum),
                }
            }
            ("softmax" | "log_softmax" | "_softmax" | "_log_softmax", _) => {
                if a.bool("half_to_float", false)? {
                    return Err(Error::unsupported("softmax with half_to_float=True"));
                }
                let x = self.t(c, "self")?;
                let x = self.with_dtype(c, x)?;
                let dim = self.dim(c, "dim", -1, self.rank(x))?;
                self.finish(
                    c,
                    Op::Softmax {
                        dim,
                        log: name.contains("log"),
                    },
                    vec![Some(x)],
                )
            }
            ("topk", "default") => {
                let x = self.t(c, "self")?;
                let k = usize::try_from(a.int("k", 1)?).map_err(|_| Error::format("negative k"))?;
                let dim = self.dim(c, "dim", -1, self.rank(x))?;
                let op = Op::TopK {
                    k,
                    dim,
                    largest: a.bool("largest", true)?,
                    sorted: a.bool("sorted", true)?,
                };
                self.finish(c, op, vec![Some(x)])
            }
            ("sort" | "argsort", "default" | "stable") => {
                // a top-k of every element; ties may come in another order
                // than PyTorch's (its unstable sort promises none)
                let x = self.t(c, "self")?;
                let (dim, k) = self.sized_dim(c, "dim", -1, &self.shape(x))?;
                let op = Op::TopK {
                    k,
                    dim,
                    largest: a.bool("descending", false)?,
                    sorted: true,
                };
                let outs = self.emit(c, op, vec![Some(x)])?;
                if name == "argsort" {
                    return self.bind(c, 0, outs[1]).map(|()| true);
                }
                self.bind(c, 0, outs[0])?;
                self.bind(c, 1, outs[1])
            }
            _ => return Ok(false),
        };
        lowered.map(|()| true)
    }
}
