//! The symbolic-int calls ExecuTorch emits for dynamic shapes: each reads
//! a tensor's current size or combines `Int`/`Double`/`Bool` values, and
//! writes one such value that later calls name (a `view_copy` size, a
//! `slice_copy` end). Checked against ExecuTorch 1.5.1's
//! `exir/passes/executorch_prim_ops_registry.py` (the `executorch_prim`
//! ops, Python semantics) and `replace_sym_size_op_pass.py`.

use etmetal_core::{Error, Result, Scalar};

use crate::schema::{EValue, Operator};

/// A scalar operation of `executorch_prim`, with Python's semantics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prim {
    Add,
    Sub,
    Mul,
    FloorDiv,
    TrueDiv,
    Mod,
    Neg,
    Eq,
    Ne,
    Gt,
    Ge,
    Lt,
    Le,
    Max,
    Min,
    Float,
    Int,
    Not,
    Ite,
    Ceil,
    Round,
    Trunc,
}

/// A symbolic-int call: inputs and the value it writes, as value indices.
#[derive(Clone, Debug, PartialEq)]
pub enum SymCall {
    /// `aten::sym_size.int(self, dim, out)`
    Size { tensor: usize, dim: i64, out: usize },
    /// `aten::sym_numel(self, out)`
    Numel { tensor: usize, out: usize },
    /// `executorch_prim::<op>.Scalar(operands…, out)`
    Prim {
        op: Prim,
        operands: Vec<usize>,
        out: usize,
    },
}

impl SymCall {
    /// The value the call writes.
    pub fn out(&self) -> usize {
        match self {
            SymCall::Size { out, .. } | SymCall::Numel { out, .. } | SymCall::Prim { out, .. } => {
                *out
            }
        }
    }
}

fn prim(name: &str) -> Option<Prim> {
    Some(match name {
        "add" => Prim::Add,
        "sub" => Prim::Sub,
        "mul" => Prim::Mul,
        "floordiv" => Prim::FloorDiv,
        "truediv" => Prim::TrueDiv,
        "mod" => Prim::Mod,
        "neg" => Prim::Neg,
        "eq" => Prim::Eq,
        "ne" => Prim::Ne,
        "gt" => Prim::Gt,
        "ge" => Prim::Ge,
        "lt" => Prim::Lt,
        "le" => Prim::Le,
        "sym_max" => Prim::Max,
        "sym_min" => Prim::Min,
        "sym_float" => Prim::Float,
        "sym_int" => Prim::Int,
        "sym_not" => Prim::Not,
        "sym_ite" => Prim::Ite,
        "ceil" => Prim::Ceil,
        "round" => Prim::Round,
        "trunc" => Prim::Trunc,
        _ => return None,
    })
}

impl Prim {
    pub fn arity(self) -> usize {
        match self {
            Prim::Neg
            | Prim::Float
            | Prim::Int
            | Prim::Not
            | Prim::Ceil
            | Prim::Round
            | Prim::Trunc => 1,
            Prim::Ite => 3,
            _ => 2,
        }
    }

    /// Apply to `x` (`arity()` operands), as Python does on ints, floats
    /// and bools; integer overflow and division by zero are errors.
    pub fn eval(self, x: &[Scalar]) -> Result<Scalar> {
        if x.len() != self.arity() {
            return Err(Error::format(format!(
                "{self:?} takes {} operands, {} given",
                self.arity(),
                x.len()
            )));
        }
        let int = |s: Scalar| match s {
            Scalar::Int(i) => Some(i),
            Scalar::Bool(b) => Some(i64::from(b)),
            Scalar::Float(_) => None,
        };
        let ints = || Some((int(x[0])?, int(*x.get(1)?)?));
        let (a, b) = (x[0].to_f64(), x.get(1).map_or(0.0, |s| s.to_f64()));
        let overflow = || Error::invalid_input(format!("{self:?} of {x:?} overflows int64"));
        let zero = || Error::invalid_input(format!("{self:?} of {x:?} divides by zero"));
        let whole = |v: f64| {
            if v.is_finite() && v.abs() < 9.2e18 {
                Ok(Scalar::Int(v as i64))
            } else {
                Err(Error::invalid_input(format!(
                    "{self:?} of {x:?} is not an int64"
                )))
            }
        };
        Ok(match self {
            Prim::Add | Prim::Sub | Prim::Mul => match ints() {
                Some((p, q)) => Scalar::Int(
                    match self {
                        Prim::Add => p.checked_add(q),
                        Prim::Sub => p.checked_sub(q),
                        _ => p.checked_mul(q),
                    }
                    .ok_or_else(overflow)?,
                ),
                None => Scalar::Float(match self {
                    Prim::Add => a + b,
                    Prim::Sub => a - b,
                    _ => a * b,
                }),
            },
            Prim::FloorDiv | Prim::Mod => match ints() {
                Some((_, 0)) => return Err(zero()),
                Some((p, q)) => {
                    let d = p.checked_div_euclid(q).ok_or_else(overflow)?;
                    // Python floors: the remainder takes the divisor's sign.
                    let (d, r) = match p.rem_euclid(q) {
                        r if r != 0 && q < 0 => (d - 1, r + q),
                        r => (d, r),
                    };
                    Scalar::Int(if self == Prim::FloorDiv { d } else { r })
                }
                None if b == 0.0 => return Err(zero()),
                None if self == Prim::FloorDiv => Scalar::Float((a / b).floor()),
                None => Scalar::Float(a - b * (a / b).floor()),
            },
            Prim::TrueDiv if b == 0.0 => return Err(zero()),
            Prim::TrueDiv => Scalar::Float(a / b),
            Prim::Neg => match int(x[0]) {
                Some(p) => Scalar::Int(p.checked_neg().ok_or_else(overflow)?),
                None => Scalar::Float(-a),
            },
            Prim::Eq | Prim::Ne | Prim::Gt | Prim::Ge | Prim::Lt | Prim::Le => {
                // ints compare exactly, not through f64
                let ord = match ints() {
                    Some((p, q)) => p.partial_cmp(&q),
                    None => a.partial_cmp(&b),
                };
                Scalar::Bool(match (self, ord) {
                    (Prim::Ne, o) => o != Some(std::cmp::Ordering::Equal),
                    (_, None) => false,
                    (Prim::Eq, Some(o)) => o.is_eq(),
                    (Prim::Gt, Some(o)) => o.is_gt(),
                    (Prim::Ge, Some(o)) => o.is_ge(),
                    (Prim::Lt, Some(o)) => o.is_lt(),
                    (_, Some(o)) => o.is_le(),
                })
            }
            // Python's max/min return one of the operands as it is.
            Prim::Max => match ints() {
                Some((p, q)) => Scalar::Int(p.max(q)),
                None if b > a => x[1],
                None => x[0],
            },
            Prim::Min => match ints() {
                Some((p, q)) => Scalar::Int(p.min(q)),
                None if b < a => x[1],
                None => x[0],
            },
            Prim::Float => Scalar::Float(a),
            Prim::Int | Prim::Trunc => whole(a.trunc())?,
            Prim::Ceil => whole(a.ceil())?,
            Prim::Round => whole(a.round_ties_even())?,
            Prim::Not => Scalar::Bool(a == 0.0),
            Prim::Ite => {
                if a != 0.0 {
                    x[1]
                } else {
                    x[2]
                }
            }
        })
    }
}

/// Read a symbolic-int call; `None` when `operator` is not one.
pub fn decode_sym(values: &[EValue], operator: &Operator, args: &[i32]) -> Option<Result<SymCall>> {
    let (name, overload) = (operator.name.as_str(), operator.overload.as_str());
    let kind = match (name, overload) {
        ("aten::sym_size", "int") => None,
        ("aten::sym_numel", "" | "default") => None,
        (n, "Scalar" | "int") => Some(prim(n.strip_prefix("executorch_prim::")?)?),
        _ => return None,
    };
    let at = |pos: usize| -> Result<usize> {
        let v = *args.get(pos).ok_or_else(|| {
            Error::format(format!(
                "argument {pos} is missing ({} arguments given)",
                args.len()
            ))
        })?;
        usize::try_from(v)
            .ok()
            .filter(|&v| v < values.len())
            .ok_or_else(|| {
                Error::format(format!(
                    "argument {pos}: value index {v} is out of range ({} values)",
                    values.len()
                ))
            })
    };
    let scalar = |pos: usize| -> Result<usize> {
        let v = at(pos)?;
        match &values[v] {
            EValue::Int(_) | EValue::Double(_) | EValue::Bool(_) => Ok(v),
            other => Err(Error::format(format!(
                "argument {pos}: expected an Int, Double or Bool, got {other:?}"
            ))),
        }
    };
    let tensor = |pos: usize| -> Result<usize> {
        let v = at(pos)?;
        match &values[v] {
            EValue::Tensor(_) => Ok(v),
            _ => Err(Error::format(format!("argument {pos}: expected a tensor"))),
        }
    };
    let call = (|| match kind {
        None if name == "aten::sym_size" => {
            let dim = match &values[at(1)?] {
                EValue::Int(d) => *d,
                _ => return Err(Error::format("argument 1: expected an Int dim")),
            };
            Ok(SymCall::Size {
                tensor: tensor(0)?,
                dim,
                out: scalar(2)?,
            })
        }
        None => Ok(SymCall::Numel {
            tensor: tensor(0)?,
            out: scalar(1)?,
        }),
        Some(op) => Ok(SymCall::Prim {
            op,
            operands: (0..op.arity()).map(scalar).collect::<Result<_>>()?,
            out: scalar(op.arity())?,
        }),
    })();
    Some(call.map_err(|e| e.context(format!("kernel {}", operator.qualified_name()))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use Scalar::{Bool as B, Float as F, Int as I};

    #[test]
    fn python_semantics() {
        let cases: &[(Prim, &[Scalar], Scalar)] = &[
            (Prim::Add, &[I(3), I(4)], I(7)),
            (Prim::Mul, &[I(3), F(0.5)], F(1.5)),
            (Prim::FloorDiv, &[I(-7), I(2)], I(-4)),
            (Prim::FloorDiv, &[I(7), I(-2)], I(-4)),
            (Prim::Mod, &[I(-7), I(2)], I(1)),
            (Prim::Mod, &[I(7), I(-2)], I(-1)),
            (Prim::TrueDiv, &[I(7), I(2)], F(3.5)),
            (Prim::Neg, &[I(5)], I(-5)),
            (Prim::Lt, &[I(2), F(2.5)], B(true)),
            (Prim::Max, &[I(2), I(9)], I(9)),
            (Prim::Min, &[F(2.5), I(9)], F(2.5)),
            (Prim::Round, &[F(2.5)], I(2)),
            (Prim::Ceil, &[F(2.1)], I(3)),
            (Prim::Int, &[F(-2.7)], I(-2)),
            (Prim::Not, &[B(false)], B(true)),
            (Prim::Ite, &[B(false), I(1), I(2)], I(2)),
        ];
        for (op, x, want) in cases {
            assert_eq!(op.eval(x).unwrap(), *want, "{op:?} {x:?}");
        }
        assert!(Prim::FloorDiv.eval(&[I(1), I(0)]).is_err());
        assert!(Prim::Mul.eval(&[I(i64::MAX), I(2)]).is_err());
        assert!(Prim::Add.eval(&[I(1)]).is_err());
    }

    #[test]
    fn decodes_executorch_calls() {
        let t = EValue::Tensor(crate::schema::Tensor::contiguous(
            etmetal_core::DType::F32,
            vec![2],
            0,
            None,
        ));
        let values = vec![
            t,
            EValue::Int(0),
            EValue::Int(0),
            EValue::Int(2),
            EValue::Null,
        ];
        let op = |name: &str, overload: &str| Operator {
            name: name.into(),
            overload: overload.into(),
        };
        let size = decode_sym(&values, &op("aten::sym_size", "int"), &[0, 1, 2]);
        assert_eq!(
            size.unwrap().unwrap(),
            SymCall::Size {
                tensor: 0,
                dim: 0,
                out: 2
            }
        );
        let mul = decode_sym(&values, &op("executorch_prim::mul", "Scalar"), &[2, 3, 1]);
        assert_eq!(mul.unwrap().unwrap().out(), 1);
        assert!(decode_sym(&values, &op("aten::add", "out"), &[]).is_none());
        let e = decode_sym(&values, &op("executorch_prim::mul", "Scalar"), &[2, 4, 1])
            .unwrap()
            .unwrap_err();
        assert!(e.to_string().contains("executorch_prim::mul.Scalar"), "{e}");
        let e = decode_sym(&values, &op("executorch_prim::neg", "Scalar"), &[2])
            .unwrap()
            .unwrap_err();
        assert!(e.to_string().contains("argument 1 is missing"), "{e}");
    }
}
