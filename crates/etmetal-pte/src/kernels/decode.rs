//! ExecuTorch kernel call → [`Op`]: the runtime direction of the calling
//! conventions.
//!
//! `KernelCall.args` hold one value index per argument of the out-variant
//! schema, in schema order with defaults materialised (the `out` tensors are
//! schema arguments too), then the returned value(s) again. The table below
//! was checked against `torch.ops.aten.<op>.<overload>._schema` (torch 2.15)
//! and against the programs ExecuTorch 1.5.1 emits for the parity zoo
//! (`scripts/survey_pte_ops.py`).
//!
//! Scalar operands (`add.Scalar_out`'s `other`, `where`'s value of
//! `masked_fill`) are input slots that name an `Int`, `Double` or `Bool`
//! value: the caller passes them to the op as 0-d tensors (see
//! [`Decoded`]; the op set takes every operand of a binary op as a tensor).

use etmetal_core::shape::normalize_dim;
use etmetal_core::{BinaryOp, DType, Error, Op, ReduceOp, Result, Scalar, UnaryOp};

use super::Decoded;
use crate::schema::{EValue, Operator, Tensor};

/// A kernel call read as ops. Most calls are one op; `split_with_sizes_copy`
/// and friends are one slice per piece.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedCall {
    pub ops: Vec<Decoded>,
    /// `out` tensors of the call that no op writes (the mean and rstd of
    /// `native_layer_norm`, the saved statistics of batch norm): a runtime
    /// must fill them or refuse a program that reads them later.
    pub unwritten: Vec<usize>,
}

/// Read a kernel call of `operator` with argument value indices `args` as a
/// single op (calls that become several ops, like splits, are an error here:
/// use [`decode_call`]).
pub fn decode(values: &[EValue], operator: &Operator, args: &[i32]) -> Result<Decoded> {
    let mut call = decode_call(values, operator, args)?;
    if call.ops.len() != 1 {
        return Err(Error::unsupported(format!(
            "{} decodes to {} ops, not one",
            operator.qualified_name(),
            call.ops.len()
        )));
    }
    Ok(call.ops.remove(0))
}

/// Read a kernel call of `operator` with argument value indices `args`.
pub fn decode_call(values: &[EValue], operator: &Operator, args: &[i32]) -> Result<DecodedCall> {
    let name = operator.qualified_name();
    let a = Args {
        values,
        args,
        name: &name,
    };
    table(&a, operator.name.as_str(), operator.overload.as_str())
        .map_err(|e| e.context(format!("kernel {name}")))
}

/// The arguments of one call, read by schema position with type checks.
struct Args<'a> {
    values: &'a [EValue],
    args: &'a [i32],
    name: &'a str,
}

impl<'a> Args<'a> {
    fn index(&self, pos: usize) -> Result<usize> {
        let v = *self.args.get(pos).ok_or_else(|| {
            Error::format(format!(
                "argument {pos} is missing ({} arguments given)",
                self.args.len()
            ))
        })?;
        self.check_value(v, pos)
    }

    fn check_value(&self, v: i32, pos: usize) -> Result<usize> {
        if v < 0 || v as usize >= self.values.len() {
            return Err(Error::format(format!(
                "argument {pos}: value index {v} is out of range ({} values)",
                self.values.len()
            )));
        }
        Ok(v as usize)
    }

    fn value(&self, pos: usize) -> Result<&'a EValue> {
        Ok(&self.values[self.index(pos)?])
    }

    fn wrong(&self, pos: usize, want: &str) -> Error {
        let got = match self.value(pos) {
            Ok(v) => kind(v),
            Err(e) => return e,
        };
        Error::format(format!("argument {pos}: expected {want}, got {got}"))
    }

    /// A tensor argument: its value index.
    fn tensor(&self, pos: usize) -> Result<usize> {
        match self.value(pos)? {
            EValue::Tensor(_) => self.index(pos),
            _ => Err(self.wrong(pos, "a tensor")),
        }
    }

    fn meta(&self, pos: usize) -> Result<&'a Tensor> {
        match self.value(pos)? {
            EValue::Tensor(t) => Ok(t),
            _ => Err(self.wrong(pos, "a tensor")),
        }
    }

    fn rank(&self, pos: usize) -> Result<usize> {
        Ok(self.meta(pos)?.sizes.len())
    }

    fn shape(&self, pos: usize) -> Result<Vec<usize>> {
        self.meta(pos)?
            .sizes
            .iter()
            .map(|&s| {
                usize::try_from(s)
                    .map_err(|_| Error::format(format!("argument {pos}: negative size {s}")))
            })
            .collect()
    }

    fn dtype(&self, pos: usize) -> Result<DType> {
        Ok(self.meta(pos)?.scalar_type)
    }

    /// `Tensor?`: `None` for `Null`.
    fn opt_tensor(&self, pos: usize) -> Result<Option<usize>> {
        match self.value(pos)? {
            EValue::Null => Ok(None),
            _ => self.tensor(pos).map(Some),
        }
    }

    /// A scalar operand passed as a tensor slot (see the module docs).
    fn scalar_slot(&self, pos: usize) -> Result<usize> {
        match self.value(pos)? {
            EValue::Int(_) | EValue::Double(_) | EValue::Bool(_) => self.index(pos),
            _ => Err(self.wrong(pos, "a scalar")),
        }
    }

    fn int(&self, pos: usize) -> Result<i64> {
        match self.value(pos)? {
            EValue::Int(v) => Ok(*v),
            _ => Err(self.wrong(pos, "an int")),
        }
    }

    fn opt_int(&self, pos: usize) -> Result<Option<i64>> {
        match self.value(pos)? {
            EValue::Null => Ok(None),
            _ => self.int(pos).map(Some),
        }
    }

    fn bool(&self, pos: usize) -> Result<bool> {
        match self.value(pos)? {
            EValue::Bool(v) => Ok(*v),
            _ => Err(self.wrong(pos, "a bool")),
        }
    }

    fn float(&self, pos: usize) -> Result<f64> {
        match self.value(pos)? {
            EValue::Double(v) => Ok(*v),
            EValue::Int(v) => Ok(*v as f64),
            _ => Err(self.wrong(pos, "a float")),
        }
    }

    fn scalar(&self, pos: usize) -> Result<Scalar> {
        match self.value(pos)? {
            EValue::Int(v) => Ok(Scalar::Int(*v)),
            EValue::Double(v) => Ok(Scalar::Float(*v)),
            EValue::Bool(v) => Ok(Scalar::Bool(*v)),
            _ => Err(self.wrong(pos, "a scalar")),
        }
    }

    fn opt_scalar(&self, pos: usize) -> Result<Option<Scalar>> {
        match self.value(pos)? {
            EValue::Null => Ok(None),
            _ => self.scalar(pos).map(Some),
        }
    }

    fn opt_string(&self, pos: usize) -> Result<Option<&'a str>> {
        match self.value(pos)? {
            EValue::Null => Ok(None),
            EValue::String(s) => Ok(Some(s.as_str())),
            _ => Err(self.wrong(pos, "a string")),
        }
    }

    /// `int[]`: an `IntList` whose items are value indices of `Int`s.
    fn ints(&self, pos: usize) -> Result<Vec<i64>> {
        let EValue::IntList(items) = self.value(pos)? else {
            return Err(self.wrong(pos, "an int list"));
        };
        items
            .iter()
            .map(|&i| {
                let v = i32::try_from(i).map_err(|_| {
                    Error::format(format!("argument {pos}: int list item {i} is out of range"))
                })?;
                match &self.values[self.check_value(v, pos)?] {
                    EValue::Int(x) => Ok(*x),
                    other => Err(Error::format(format!(
                        "argument {pos}: int list item {i} is {}, not an Int",
                        kind(other)
                    ))),
                }
            })
            .collect()
    }

    fn opt_ints(&self, pos: usize) -> Result<Option<Vec<i64>>> {
        match self.value(pos)? {
            EValue::Null => Ok(None),
            _ => self.ints(pos).map(Some),
        }
    }

    /// `Tensor[]`: value indices of the items.
    fn tensor_list(&self, pos: usize) -> Result<Vec<usize>> {
        let EValue::TensorList(items) = self.value(pos)? else {
            return Err(self.wrong(pos, "a tensor list"));
        };
        items.iter().map(|&i| self.list_tensor(i, pos)).collect()
    }

    /// `Tensor?[]`: -1 is an absent item.
    fn opt_tensor_list(&self, pos: usize) -> Result<Vec<Option<usize>>> {
        let EValue::OptionalTensorList(items) = self.value(pos)? else {
            return Err(self.wrong(pos, "an optional tensor list"));
        };
        items
            .iter()
            .map(|&i| {
                if i == -1 {
                    Ok(None)
                } else {
                    self.list_tensor(i, pos).map(Some)
                }
            })
            .collect()
    }

    fn list_tensor(&self, i: i32, pos: usize) -> Result<usize> {
        let v = self.check_value(i, pos)?;
        match &self.values[v] {
            EValue::Tensor(_) => Ok(v),
            other => Err(Error::format(format!(
                "argument {pos}: list item {i} is {}, not a tensor",
                kind(other)
            ))),
        }
    }

    /// A dim of the tensor at `tensor_pos`, normalised.
    fn dim(&self, pos: usize, tensor_pos: usize) -> Result<usize> {
        normalize_dim(self.int(pos)?, self.rank(tensor_pos)?)
            .map_err(|e| e.context(format!("argument {pos}")))
    }

    /// `int[]` dims of the tensor at `tensor_pos`, normalised.
    fn dims(&self, list: &[i64], tensor_pos: usize) -> Result<Vec<usize>> {
        let rank = self.rank(tensor_pos)?;
        list.iter().map(|&d| normalize_dim(d, rank)).collect()
    }

    /// `int[]` attributes that must be non-negative (strides, kernel sizes).
    fn sizes(&self, pos: usize) -> Result<Vec<usize>> {
        self.ints(pos)?
            .into_iter()
            .map(|v| {
                usize::try_from(v)
                    .map_err(|_| Error::format(format!("argument {pos}: {v} is negative")))
            })
            .collect()
    }
}

fn kind(v: &EValue) -> &'static str {
    match v {
        EValue::Null => "Null",
        EValue::Int(_) => "Int",
        EValue::Bool(_) => "Bool",
        EValue::Double(_) => "Double",
        EValue::Tensor(_) => "Tensor",
        EValue::String(_) => "String",
        EValue::IntList(_) => "IntList",
        EValue::DoubleList(_) => "DoubleList",
        EValue::BoolList(_) => "BoolList",
        EValue::TensorList(_) => "TensorList",
        EValue::OptionalTensorList(_) => "OptionalTensorList",
    }
}

fn one(op: Op, inputs: Vec<Option<usize>>, outputs: Vec<usize>) -> Result<DecodedCall> {
    Ok(DecodedCall {
        ops: vec![Decoded {
            op,
            inputs,
            outputs,
        }],
        unwritten: Vec::new(),
    })
}

fn unary(a: &Args, u: UnaryOp, out: usize) -> Result<DecodedCall> {
    one(Op::Unary(u), vec![Some(a.tensor(0)?)], vec![a.tensor(out)?])
}

/// `op(self, other[, alpha], out)` where `other` is a tensor or a scalar.
fn binary(
    a: &Args,
    b: BinaryOp,
    scalar_other: bool,
    alpha: Option<usize>,
    out: usize,
) -> Result<DecodedCall> {
    if let Some(pos) = alpha {
        let alpha = a.scalar(pos)?.to_f64();
        if alpha != 1.0 {
            // Scaling `other` would need an extra op; ExecuTorch's exporter
            // writes alpha = 1 for every `+`/`-` in Python.
            return Err(Error::unsupported(format!(
                "{} with alpha = {alpha} (only 1 is supported)",
                a.name
            )));
        }
    }
    let other = if scalar_other {
        a.scalar_slot(1)?
    } else {
        a.tensor(1)?
    };
    one(
        Op::Binary(b),
        vec![Some(a.tensor(0)?), Some(other)],
        vec![a.tensor(out)?],
    )
}

fn clamp_f64(s: Option<Scalar>) -> Option<f64> {
    s.map(Scalar::to_f64)
}

/// PyTorch's slice bound clamping for a dim of `size`.
fn slice_bound(v: i64, size: usize) -> usize {
    let size = size as i64;
    let v = if v < 0 { v + size } else { v };
    v.clamp(0, size) as usize
}

/// A `dim_order` argument other than the identity would ask for a
/// non-contiguous layout, which etmetal's host tensors do not have.
fn contiguous_dim_order(a: &Args, pos: usize) -> Result<()> {
    if let Some(order) = a.opt_ints(pos)? {
        if order.iter().enumerate().any(|(i, &d)| d != i as i64) {
            return Err(Error::unsupported(format!(
                "dim_order {order:?} (only contiguous tensors are supported)"
            )));
        }
    }
    Ok(())
}

/// One slice per output of a split along `dim`.
fn split(a: &Args, dim: usize, pieces: &[usize]) -> Result<DecodedCall> {
    let x = a.tensor(0)?;
    let size = *a.shape(0)?.get(dim).unwrap_or(&1);
    let mut start = 0usize;
    let mut ops = Vec::new();
    for &out in pieces {
        let len = a.values.get(out).and_then(|v| match v {
            EValue::Tensor(t) => t.sizes.get(dim).map(|&s| s.max(0) as usize),
            _ => None,
        });
        let len =
            len.ok_or_else(|| Error::format(format!("split output {out} has no dim {dim}")))?;
        let end = start.saturating_add(len);
        if end > size {
            return Err(Error::shape(format!(
                "split pieces cover more than the {size} elements of dim {dim}"
            )));
        }
        ops.push(Decoded {
            op: Op::Slice {
                dim,
                start,
                end,
                step: 1,
            },
            inputs: vec![Some(x)],
            outputs: vec![out],
        });
        start = end;
    }
    Ok(DecodedCall {
        ops,
        unwritten: Vec::new(),
    })
}

fn reduce(
    a: &Args,
    op: ReduceOp,
    dims: Option<Vec<i64>>,
    keepdim: bool,
    out: usize,
) -> Result<DecodedCall> {
    let dims = a.dims(&dims.unwrap_or_default(), 0)?;
    one(
        Op::Reduce { op, dims, keepdim },
        vec![Some(a.tensor(0)?)],
        vec![a.tensor(out)?],
    )
}

/// `Full` of the out tensor's shape and dtype.
fn full(a: &Args, value: Scalar, out: usize) -> Result<DecodedCall> {
    let op = Op::Full {
        shape: a.shape(out)?,
        value,
        dtype: a.dtype(out)?,
    };
    one(op, vec![], vec![a.tensor(out)?])
}

/// The same elements under the out tensor's shape.
fn reshape(a: &Args, out: usize) -> Result<DecodedCall> {
    one(
        Op::Reshape {
            shape: a.shape(out)?,
        },
        vec![Some(a.tensor(0)?)],
        vec![a.tensor(out)?],
    )
}

fn softmax(a: &Args, log: bool) -> Result<DecodedCall> {
    if a.bool(2)? {
        return Err(Error::unsupported("half_to_float = true"));
    }
    one(
        Op::Softmax {
            dim: a.dim(1, 0)?,
            log,
        },
        vec![Some(a.tensor(0)?)],
        vec![a.tensor(3)?],
    )
}

fn table(a: &Args, name: &str, overload: &str) -> Result<DecodedCall> {
    use BinaryOp as B;
    use UnaryOp as U;
    let Some(op) = name.strip_prefix("aten::") else {
        return match (name, overload) {
            // `_to_copy` / `clone` with a dim order; dtype is the out tensor's.
            ("dim_order_ops::_to_dim_order_copy", "out") => {
                contiguous_dim_order(a, 2)?;
                one(
                    Op::Cast { dtype: a.dtype(3)? },
                    vec![Some(a.tensor(0)?)],
                    vec![a.tensor(3)?],
                )
            }
            ("dim_order_ops::_clone_dim_order", "out") => {
                contiguous_dim_order(a, 2)?;
                one(Op::Identity, vec![Some(a.tensor(0)?)], vec![a.tensor(3)?])
            }
            ("dim_order_ops::_empty_dim_order", "out") => {
                contiguous_dim_order(a, 1)?;
                full(a, Scalar::Int(0), 2)
            }
            _ => Err(unsupported(a)),
        };
    };
    match (op, overload) {
        // ---- unary: (self, out)
        ("abs", "out") => unary(a, U::Abs, 1),
        ("ceil", "out") => unary(a, U::Ceil, 1),
        ("cos", "out") => unary(a, U::Cos, 1),
        ("erf", "out") => unary(a, U::Erf, 1),
        ("exp", "out") => unary(a, U::Exp, 1),
        ("floor", "out") => unary(a, U::Floor, 1),
        ("log", "out") => unary(a, U::Log, 1),
        ("neg", "out") => unary(a, U::Neg, 1),
        ("reciprocal", "out") => unary(a, U::Reciprocal, 1),
        ("relu", "out") => unary(a, U::Relu, 1),
        ("round", "out") => unary(a, U::Round, 1),
        ("rsqrt", "out") => unary(a, U::Rsqrt, 1),
        ("sigmoid", "out") => unary(a, U::Sigmoid, 1),
        ("sign", "out") => unary(a, U::Sign, 1),
        ("sin", "out") => unary(a, U::Sin, 1),
        ("sqrt", "out") => unary(a, U::Sqrt, 1),
        ("tanh", "out") => unary(a, U::Tanh, 1),
        ("logical_not", "out") => unary(a, U::LogicalNot, 1),
        ("bitwise_not", "out") => unary(a, U::BitwiseNot, 1),
        // (self, approximate, out)
        ("gelu", "out") => {
            let tanh = match a.opt_string(1)?.unwrap_or("none") {
                "none" => false,
                "tanh" => true,
                other => return Err(Error::unsupported(format!("gelu approximate = {other:?}"))),
            };
            unary(a, U::Gelu { tanh }, 2)
        }
        // (self, min_val, max_val, out)
        ("hardtanh", "out") => {
            let u = U::Clamp {
                min: Some(a.scalar(1)?.to_f64()),
                max: Some(a.scalar(2)?.to_f64()),
            };
            unary(a, u, 3)
        }
        // (self, min?, max?, out)
        ("clamp", "out") => {
            let u = U::Clamp {
                min: clamp_f64(a.opt_scalar(1)?),
                max: clamp_f64(a.opt_scalar(2)?),
            };
            unary(a, u, 3)
        }
        // (self, negative_slope, out)
        ("leaky_relu", "out") => unary(
            a,
            U::LeakyRelu {
                slope: a.scalar(1)?.to_f64(),
            },
            2,
        ),
        // (self, exponent, out)
        ("pow", "Tensor_Scalar_out") => unary(
            a,
            U::PowScalar {
                exponent: a.scalar(1)?.to_f64(),
            },
            2,
        ),

        // ---- binary: (self, other[, alpha], out)
        ("add", "out") => binary(a, B::Add, false, Some(2), 3),
        ("add", "Scalar_out") => binary(a, B::Add, true, Some(2), 3),
        ("sub", "out") => binary(a, B::Sub, false, Some(2), 3),
        ("sub", "Scalar_out") => binary(a, B::Sub, true, Some(2), 3),
        ("mul", "out") => binary(a, B::Mul, false, None, 2),
        ("mul", "Scalar_out") => binary(a, B::Mul, true, None, 2),
        ("div", "out") => binary(a, B::Div, false, None, 2),
        ("div", "Scalar_out") => binary(a, B::Div, true, None, 2),
        // (self, other, rounding_mode?, out)
        ("div", "out_mode") | ("div", "Scalar_mode_out") => {
            let b = match a.opt_string(2)? {
                None => B::Div,
                Some("floor") => B::FloorDiv,
                Some("trunc") => B::TruncDiv,
                Some(other) => return Err(Error::unsupported(format!("rounding_mode {other:?}"))),
            };
            binary(a, b, overload == "Scalar_mode_out", None, 3)
        }
        ("floor_divide", "out") => binary(a, B::FloorDiv, false, None, 2),
        ("remainder", "Tensor_out") => binary(a, B::Remainder, false, None, 2),
        ("remainder", "Scalar_out") => binary(a, B::Remainder, true, None, 2),
        ("pow", "Tensor_Tensor_out") => binary(a, B::Pow, false, None, 2),
        // (Scalar self, Tensor exponent, out)
        ("pow", "Scalar_out") => one(
            Op::Binary(B::Pow),
            vec![Some(a.scalar_slot(0)?), Some(a.tensor(1)?)],
            vec![a.tensor(2)?],
        ),
        // other - alpha * self: (self, other, alpha, out)
        ("rsub", "Scalar_out") => {
            if a.scalar(2)?.to_f64() != 1.0 {
                return Err(Error::unsupported("rsub with alpha != 1"));
            }
            one(
                Op::Binary(B::Sub),
                vec![Some(a.scalar_slot(1)?), Some(a.tensor(0)?)],
                vec![a.tensor(3)?],
            )
        }
        ("maximum", "out") => binary(a, B::Maximum, false, None, 2),
        ("minimum", "out") => binary(a, B::Minimum, false, None, 2),
        ("logical_and", "out") => binary(a, B::LogicalAnd, false, None, 2),
        ("logical_or", "out") => binary(a, B::LogicalOr, false, None, 2),
        ("logical_xor", "out") => binary(a, B::LogicalXor, false, None, 2),
        (cmp @ ("eq" | "ne" | "lt" | "le" | "gt" | "ge"), ov @ ("Tensor_out" | "Scalar_out")) => {
            let b = match cmp {
                "eq" => B::Eq,
                "ne" => B::Ne,
                "lt" => B::Lt,
                "le" => B::Le,
                "gt" => B::Gt,
                _ => B::Ge,
            };
            binary(a, b, ov == "Scalar_out", None, 2)
        }
        (
            bit @ ("bitwise_and" | "bitwise_or" | "bitwise_xor"),
            ov @ ("Tensor_out" | "Scalar_out"),
        ) => {
            let b = match bit {
                "bitwise_and" => B::BitwiseAnd,
                "bitwise_or" => B::BitwiseOr,
                _ => B::BitwiseXor,
            };
            binary(a, b, ov == "Scalar_out", None, 2)
        }
        // (condition, self, other, out)
        ("where", "self_out") => one(
            Op::Where,
            vec![Some(a.tensor(0)?), Some(a.tensor(1)?), Some(a.tensor(2)?)],
            vec![a.tensor(3)?],
        ),
        // (self, mask, value, out) = where(mask, value, self)
        ("masked_fill", "Scalar_out") => one(
            Op::Where,
            vec![
                Some(a.tensor(1)?),
                Some(a.scalar_slot(2)?),
                Some(a.tensor(0)?),
            ],
            vec![a.tensor(3)?],
        ),

        // ---- copies and casts
        // (self, non_blocking, memory_format?, out): dtype is the out tensor's
        ("_to_copy", "out") => one(
            Op::Cast { dtype: a.dtype(3)? },
            vec![Some(a.tensor(0)?)],
            vec![a.tensor(3)?],
        ),
        // (self, memory_format?, out)
        ("clone", "out") => one(Op::Identity, vec![Some(a.tensor(0)?)], vec![a.tensor(2)?]),
        ("alias_copy" | "detach_copy" | "lift_fresh_copy", "out") => {
            one(Op::Identity, vec![Some(a.tensor(0)?)], vec![a.tensor(1)?])
        }

        // ---- reductions
        // (self, dim?, keepdim, dtype?, out)
        ("sum", "IntList_out") => reduce(a, ReduceOp::Sum, a.opt_ints(1)?, a.bool(2)?, 4),
        ("mean", "out") => reduce(a, ReduceOp::Mean, a.opt_ints(1)?, a.bool(2)?, 4),
        // (self, dtype?, out)
        ("mean", "dtype_out") => reduce(a, ReduceOp::Mean, None, false, 2),
        // (self, dim[], keepdim, out)
        ("amax", "out") => reduce(a, ReduceOp::Max, Some(a.ints(1)?), a.bool(2)?, 3),
        ("amin", "out") => reduce(a, ReduceOp::Min, Some(a.ints(1)?), a.bool(2)?, 3),
        // (self, out)
        ("any", "all_out") => reduce(a, ReduceOp::Any, None, false, 1),
        ("max", "unary_out") => reduce(a, ReduceOp::Max, None, false, 1),
        ("min", "unary_out") => reduce(a, ReduceOp::Min, None, false, 1),
        // (self, dim?, keepdim, out)
        ("any", "dims_out") => reduce(a, ReduceOp::Any, a.opt_ints(1)?, a.bool(2)?, 3),
        // (self, dim, keepdim, out)
        ("any", "out") => reduce(a, ReduceOp::Any, Some(vec![a.int(1)?]), a.bool(2)?, 3),
        // (self, dim, keepdim, dtype?, out)
        ("prod", "int_out") => reduce(a, ReduceOp::Prod, Some(vec![a.int(1)?]), a.bool(2)?, 4),
        // (self, dtype?, out)
        ("prod", "out") => reduce(a, ReduceOp::Prod, None, false, 2),
        // (self, dim?, correction?, keepdim, out)
        ("var", "correction_out") => {
            let dims = a.dims(&a.opt_ints(1)?.unwrap_or_default(), 0)?;
            let correction = a.opt_scalar(2)?.map_or(1.0, Scalar::to_f64);
            let op = Op::Var {
                dims,
                correction,
                keepdim: a.bool(3)?,
            };
            one(op, vec![Some(a.tensor(0)?)], vec![a.tensor(4)?])
        }
        // (self, dim?, unbiased, keepdim, out)
        ("var", "out") => {
            let dims = a.dims(&a.opt_ints(1)?.unwrap_or_default(), 0)?;
            let correction = if a.bool(2)? { 1.0 } else { 0.0 };
            let op = Op::Var {
                dims,
                correction,
                keepdim: a.bool(3)?,
            };
            one(op, vec![Some(a.tensor(0)?)], vec![a.tensor(4)?])
        }
        // (self, dim?, keepdim, out)
        ("argmax" | "argmin", "out") => {
            let dim = match a.opt_int(1)? {
                Some(d) => Some(normalize_dim(d, a.rank(0)?)?),
                None => None,
            };
            let op = Op::ArgReduce {
                max: op == "argmax",
                dim,
                keepdim: a.bool(2)?,
            };
            one(op, vec![Some(a.tensor(0)?)], vec![a.tensor(3)?])
        }
        // (self, dim, keepdim, values, indices)
        ("max", "dim_max") | ("min", "dim_min") => {
            let op = Op::ReduceWithIndices {
                max: op == "max",
                dim: a.dim(1, 0)?,
                keepdim: a.bool(2)?,
            };
            one(
                op,
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(3)?, a.tensor(4)?],
            )
        }
        // (self, dim, dtype?, out)
        ("cumsum", "out") => one(
            Op::CumSum { dim: a.dim(1, 0)? },
            vec![Some(a.tensor(0)?)],
            vec![a.tensor(3)?],
        ),
        // (self, dim, half_to_float, out)
        ("_softmax", "out") => softmax(a, false),
        ("_log_softmax", "out") => softmax(a, true),
        // (self, k, dim, largest, sorted, values, indices)
        ("topk", "values") => {
            let k =
                usize::try_from(a.int(1)?).map_err(|_| Error::format("topk with a negative k"))?;
            let op = Op::TopK {
                k,
                dim: a.dim(2, 0)?,
                largest: a.bool(3)?,
                sorted: a.bool(4)?,
            };
            one(
                op,
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(5)?, a.tensor(6)?],
            )
        }

        // ---- norms (extra statistics outputs are reported, not computed)
        // (input, normalized_shape, weight?, bias?, eps, out0, out1, out2)
        ("native_layer_norm", "out") => {
            let op = Op::LayerNorm {
                normalized_dims: a.ints(1)?.len(),
                eps: a.float(4)?,
            };
            let inputs = vec![Some(a.tensor(0)?), a.opt_tensor(2)?, a.opt_tensor(3)?];
            Ok(DecodedCall {
                ops: vec![Decoded {
                    op,
                    inputs,
                    outputs: vec![a.tensor(5)?],
                }],
                unwritten: vec![a.tensor(6)?, a.tensor(7)?],
            })
        }
        // (input, weight?, bias?, running_mean, running_var, momentum, eps, out0, out1, out2)
        ("_native_batch_norm_legit_no_training", "out") => {
            let inputs = vec![
                Some(a.tensor(0)?),
                a.opt_tensor(1)?,
                a.opt_tensor(2)?,
                Some(a.tensor(3)?),
                Some(a.tensor(4)?),
            ];
            Ok(DecodedCall {
                ops: vec![Decoded {
                    op: Op::BatchNorm { eps: a.float(6)? },
                    inputs,
                    outputs: vec![a.tensor(7)?],
                }],
                unwritten: vec![a.tensor(8)?, a.tensor(9)?],
            })
        }
        // (input, weight?, bias?, N, C, HxW, group, eps, out0, out1, out2)
        ("native_group_norm", "out") => {
            let groups = usize::try_from(a.int(6)?)
                .map_err(|_| Error::format("group_norm with negative groups"))?;
            let op = Op::GroupNorm {
                groups,
                eps: a.float(7)?,
            };
            let inputs = vec![Some(a.tensor(0)?), a.opt_tensor(1)?, a.opt_tensor(2)?];
            Ok(DecodedCall {
                ops: vec![Decoded {
                    op,
                    inputs,
                    outputs: vec![a.tensor(8)?],
                }],
                unwritten: vec![a.tensor(9)?, a.tensor(10)?],
            })
        }

        // ---- matmul and convolution
        ("mm" | "bmm", "out") => one(
            Op::MatMul,
            vec![Some(a.tensor(0)?), Some(a.tensor(1)?)],
            vec![a.tensor(2)?],
        ),
        // (self, mat1, mat2, beta, alpha, out)
        ("addmm", "out") => {
            let op = Op::Addmm {
                beta: a.scalar(3)?.to_f64(),
                alpha: a.scalar(4)?.to_f64(),
            };
            one(
                op,
                vec![Some(a.tensor(0)?), Some(a.tensor(1)?), Some(a.tensor(2)?)],
                vec![a.tensor(5)?],
            )
        }
        // (input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups, out)
        ("convolution", "out") => {
            let groups = usize::try_from(a.int(8)?)
                .map_err(|_| Error::format("convolution with negative groups"))?;
            let op = Op::Convolution {
                stride: a.sizes(3)?,
                padding: a.sizes(4)?,
                dilation: a.sizes(5)?,
                transposed: a.bool(6)?,
                output_padding: a.sizes(7)?,
                groups,
            };
            one(
                op,
                vec![Some(a.tensor(0)?), Some(a.tensor(1)?), a.opt_tensor(2)?],
                vec![a.tensor(9)?],
            )
        }
        // (self, kernel_size, stride, padding, dilation, ceil_mode, out, indices)
        ("max_pool2d_with_indices", "out") => {
            let kernel = a.sizes(1)?;
            let stride = a.sizes(2)?;
            let op = Op::MaxPool {
                stride: if stride.is_empty() {
                    kernel.clone()
                } else {
                    stride
                },
                kernel,
                padding: a.sizes(3)?,
                dilation: a.sizes(4)?,
                ceil_mode: a.bool(5)?,
                with_indices: true,
            };
            one(
                op,
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(6)?, a.tensor(7)?],
            )
        }
        // (self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override?, out)
        ("avg_pool2d", "out") => {
            let kernel = a.sizes(1)?;
            let stride = a.sizes(2)?;
            let op = Op::AvgPool {
                stride: if stride.is_empty() {
                    kernel.clone()
                } else {
                    stride
                },
                kernel,
                padding: a.sizes(3)?,
                ceil_mode: a.bool(4)?,
                count_include_pad: a.bool(5)?,
                divisor_override: a.opt_int(6)?,
            };
            one(op, vec![Some(a.tensor(0)?)], vec![a.tensor(7)?])
        }
        // (self, output_size, out)
        ("_adaptive_avg_pool2d", "out") => one(
            Op::AdaptiveAvgPool {
                output_size: a.sizes(1)?,
            },
            vec![Some(a.tensor(0)?)],
            vec![a.tensor(2)?],
        ),

        // ---- indexing
        // (weight, indices, padding_idx, scale_grad_by_freq, sparse, out)
        ("embedding", "out") => one(
            Op::Embedding,
            vec![Some(a.tensor(0)?), Some(a.tensor(1)?)],
            vec![a.tensor(5)?],
        ),
        // (self, dim, index, out)
        ("index_select", "out") => one(
            Op::IndexSelect { dim: a.dim(1, 0)? },
            vec![Some(a.tensor(0)?), Some(a.tensor(2)?)],
            vec![a.tensor(3)?],
        ),
        // (self, dim, index, sparse_grad, out)
        ("gather", "out") => one(
            Op::Gather { dim: a.dim(1, 0)? },
            vec![Some(a.tensor(0)?), Some(a.tensor(2)?)],
            vec![a.tensor(4)?],
        ),
        // (self, indices Tensor?[], out)
        ("index", "Tensor_out") => {
            let mut inputs = vec![Some(a.tensor(0)?)];
            inputs.extend(a.opt_tensor_list(1)?);
            one(Op::Index, inputs, vec![a.tensor(2)?])
        }
        // (self, diagonal, out)
        ("tril", "out") => one(
            Op::Triangle {
                upper: false,
                diagonal: a.int(1)?,
            },
            vec![Some(a.tensor(0)?)],
            vec![a.tensor(2)?],
        ),

        // ---- layout (shapes are the out tensor's: `-1` sizes are resolved there)
        // (self, size, out)
        ("view_copy", "out") => reshape(a, 2),
        // (self, dim | dims, out)
        ("squeeze_copy", "dim_out" | "dims_out") | ("unsqueeze_copy", "out") => reshape(a, 2),
        // (self, dims, out)
        ("permute_copy", "out") => {
            let dims = a.dims(&a.ints(1)?, 0)?;
            one(
                Op::Permute { dims },
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(2)?],
            )
        }
        // (self, dim0, dim1, out)
        ("transpose_copy", "int_out") => {
            let mut dims: Vec<usize> = (0..a.rank(0)?).collect();
            let (d0, d1) = (a.dim(1, 0)?, a.dim(2, 0)?);
            if !dims.is_empty() {
                dims.swap(d0, d1);
            }
            one(
                Op::Permute { dims },
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(3)?],
            )
        }
        // (self, out)
        ("t_copy", "out") => {
            let dims: Vec<usize> = (0..a.rank(0)?).rev().collect();
            one(
                Op::Permute { dims },
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(1)?],
            )
        }
        // (self, size, implicit, out)
        ("expand_copy", "out") => one(
            Op::Expand { shape: a.shape(3)? },
            vec![Some(a.tensor(0)?)],
            vec![a.tensor(3)?],
        ),
        // (self, dim, start?, end?, step, out)
        ("slice_copy", "Tensor_out") => {
            let dim = a.dim(1, 0)?;
            let size = a.shape(0)?.get(dim).copied().unwrap_or(1);
            let start = slice_bound(a.opt_int(2)?.unwrap_or(0), size);
            let end = slice_bound(a.opt_int(3)?.unwrap_or(i64::MAX), size).max(start);
            let step = usize::try_from(a.int(4)?)
                .ok()
                .filter(|&s| s > 0)
                .ok_or_else(|| Error::format("slice step must be positive"))?;
            one(
                Op::Slice {
                    dim,
                    start,
                    end,
                    step,
                },
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(5)?],
            )
        }
        // (self, dim, start, length, out)
        ("narrow_copy", "out") => {
            let dim = a.dim(1, 0)?;
            let size = a.shape(0)?.get(dim).copied().unwrap_or(1);
            let start = slice_bound(a.int(2)?, size);
            let len = usize::try_from(a.int(3)?)
                .map_err(|_| Error::format("narrow with a negative length"))?;
            let end = start.saturating_add(len);
            if end > size {
                return Err(Error::shape(format!(
                    "narrow {start}+{len} runs past the {size} elements of dim {dim}"
                )));
            }
            one(
                Op::Slice {
                    dim,
                    start,
                    end,
                    step: 1,
                },
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(4)?],
            )
        }
        // (self, dim, index, out)
        ("select_copy", "int_out") => {
            let dim = a.dim(1, 0)?;
            let size = a.shape(0)?.get(dim).copied().unwrap_or(1);
            let index = normalize_dim(a.int(2)?, size).map_err(|_| {
                Error::shape(format!(
                    "select index {} is out of range for size {size}",
                    a.int(2).unwrap_or(0)
                ))
            })?;
            one(
                Op::Select { dim, index },
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(3)?],
            )
        }
        // (tensors, dim, out)
        ("cat", "out") => {
            let items = a.tensor_list(0)?;
            let out = a.tensor(2)?;
            let dim = normalize_dim(a.int(1)?, a.rank(2)?)?;
            one(
                Op::Cat { dim },
                items.into_iter().map(Some).collect(),
                vec![out],
            )
        }
        // (self, split_sizes, dim, out Tensor[])
        ("split_with_sizes_copy", "out") => {
            let dim = a.dim(2, 0)?;
            split(a, dim, &a.tensor_list(3)?)
        }
        // (self, split_size, dim, out Tensor[])
        ("split_copy", "Tensor_out") => {
            let dim = a.dim(2, 0)?;
            split(a, dim, &a.tensor_list(3)?)
        }
        // (self, pad, value, out)
        ("constant_pad_nd", "out") => {
            let op = Op::ConstantPad {
                pad: a.ints(1)?,
                value: a.scalar(2)?.to_f64(),
            };
            one(op, vec![Some(a.tensor(0)?)], vec![a.tensor(3)?])
        }
        // (self, repeats, out)
        ("repeat", "out") => one(
            Op::Repeat {
                repeats: a.sizes(1)?,
            },
            vec![Some(a.tensor(0)?)],
            vec![a.tensor(2)?],
        ),

        // ---- creation: shape and dtype are the out tensor's
        // (size, fill_value, out)
        ("full", "out") => full(a, a.scalar(1)?, 2),
        // (self, fill_value, memory_format?, out)
        ("full_like", "out") => full(a, a.scalar(1)?, 3),
        // (self, value, out)
        ("fill", "Scalar_out") => full(a, a.scalar(1)?, 2),
        // (size, out)
        ("zeros", "out") => full(a, Scalar::Int(0), 1),
        ("ones", "out") => full(a, Scalar::Int(1), 1),
        // (size, memory_format?, out): contents are unspecified; zeros are one choice
        ("empty", "out") => full(a, Scalar::Int(0), 2),
        // (s, out)
        ("scalar_tensor", "out") => full(a, a.scalar(0)?, 1),
        // (end, out)
        ("arange", "out") => {
            let op = Op::Arange {
                start: Scalar::Int(0),
                end: a.scalar(0)?,
                step: Scalar::Int(1),
                dtype: a.dtype(1)?,
            };
            one(op, vec![], vec![a.tensor(1)?])
        }
        // (start, end, step, out)
        ("arange", "start_out") => {
            let op = Op::Arange {
                start: a.scalar(0)?,
                end: a.scalar(1)?,
                step: a.scalar(2)?,
                dtype: a.dtype(3)?,
            };
            one(op, vec![], vec![a.tensor(3)?])
        }
        _ => Err(unsupported(a)),
    }
}

fn unsupported(a: &Args) -> Error {
    Error::unsupported(format!(
        "ExecuTorch operator {} has no etmetal kernel",
        a.name
    ))
}
