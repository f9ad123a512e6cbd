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

use etmetal_core::op_table::{self, Elementwise};
use etmetal_core::shape::normalize_dim;
use etmetal_core::{
    AvgPoolAttrs, BinaryOp, ConvAttrs, DType, Error, MaxPoolAttrs, Op, ReduceOp, Result, Scalar,
    UnaryOp,
};

use super::Decoded;
use crate::schema::{EValue, Operator, Tensor, TensorShapeDynamism};

mod custom;

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
    // Unsupported operators name themselves; other errors get the name as context.
    table(&a, operator.name.as_str(), operator.overload.as_str()).map_err(|e| {
        if e.message().contains(&name) {
            e
        } else {
            e.context(format!("kernel {name}"))
        }
    })
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

    /// The shape of the out tensor at `out`: its sizes when static; when it
    /// is planned at an upper bound (`DYNAMIC_BOUND`), `actual` computes it
    /// from the call's arguments and the inputs' current shapes.
    fn out_shape(
        &self,
        out: usize,
        actual: impl FnOnce() -> Result<Vec<usize>>,
    ) -> Result<Vec<usize>> {
        if self.meta(out)?.shape_dynamism == TensorShapeDynamism::Static {
            self.shape(out)
        } else {
            actual()
        }
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

/// One slice per output of a split along `dim`; `lens(size)` gives the
/// pieces' lengths when the outputs are dynamic (planned at a bound).
fn split(
    a: &Args,
    dim: usize,
    pieces: &[usize],
    lens: impl Fn(usize) -> Result<Vec<usize>>,
) -> Result<DecodedCall> {
    let x = a.tensor(0)?;
    let size = *a.shape(0)?.get(dim).unwrap_or(&1);
    let dynamic = pieces.iter().any(|&out| {
        matches!(&a.values[out], EValue::Tensor(t) if t.shape_dynamism != TensorShapeDynamism::Static)
    });
    let lens = if dynamic {
        let lens = lens(size)?;
        if lens.len() != pieces.len() {
            return Err(Error::shape(format!(
                "a split of {size} elements into {} pieces has {} outputs",
                lens.len(),
                pieces.len()
            )));
        }
        lens
    } else {
        pieces
            .iter()
            .map(|&out| {
                let len = a.values.get(out).and_then(|v| match v {
                    EValue::Tensor(t) => t.sizes.get(dim).map(|&s| s.max(0) as usize),
                    _ => None,
                });
                len.ok_or_else(|| Error::format(format!("split output {out} has no dim {dim}")))
            })
            .collect::<Result<Vec<_>>>()?
    };
    let mut start = 0usize;
    let mut ops = Vec::new();
    for (&out, len) in pieces.iter().zip(lens) {
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

/// `Full` of the out tensor's shape and dtype; `size` is the argument
/// holding the shape (`None`: the shape of `self`, argument 0).
fn full(a: &Args, value: Scalar, size: Option<usize>, out: usize) -> Result<DecodedCall> {
    let op = Op::Full {
        shape: a.out_shape(out, || match size {
            Some(pos) => a.sizes(pos),
            None => a.shape(0),
        })?,
        value,
        dtype: a.dtype(out)?,
    };
    one(op, vec![], vec![a.tensor(out)?])
}

/// The same elements under the out tensor's shape; when that is dynamic,
/// `actual(input shape)` computes it.
fn reshape(
    a: &Args,
    out: usize,
    actual: impl FnOnce(&[usize]) -> Result<Vec<usize>>,
) -> Result<DecodedCall> {
    one(
        Op::Reshape {
            shape: a.out_shape(out, || actual(&a.shape(0)?))?,
        },
        vec![Some(a.tensor(0)?)],
        vec![a.tensor(out)?],
    )
}

/// `view(size)`: `size` with at most one `-1`, which takes what the other
/// dims leave of the input's elements.
fn view_shape(size: &[i64], input: &[usize]) -> Result<Vec<usize>> {
    let bad = || {
        Error::shape(format!(
            "cannot view a tensor of shape {input:?} as {size:?}"
        ))
    };
    let free = size.iter().filter(|&&s| s == -1).count();
    if size.iter().any(|&s| s < -1) || free > 1 {
        return Err(bad());
    }
    let numel = checked_product(input.iter().copied()).ok_or_else(bad)?;
    let known =
        checked_product(size.iter().filter(|&&s| s != -1).map(|&s| s as usize)).ok_or_else(bad)?;
    let shape: Vec<usize> = size
        .iter()
        .map(|&s| match s {
            -1 if known > 0 => numel / known,
            -1 => 0,
            s => s as usize,
        })
        .collect();
    if checked_product(shape.iter().copied()) != Some(numel) {
        return Err(bad());
    }
    Ok(shape)
}

fn checked_product(dims: impl Iterator<Item = usize>) -> Option<usize> {
    dims.into_iter()
        .try_fold(1usize, |acc, s| acc.checked_mul(s))
}

/// `expand(size)`: `size` aligned right with the input; `-1` keeps a dim.
fn expand_shape(size: &[i64], input: &[usize]) -> Result<Vec<usize>> {
    let lead = size.len().checked_sub(input.len()).ok_or_else(|| {
        Error::shape(format!(
            "cannot expand shape {input:?} to fewer dims {size:?}"
        ))
    })?;
    size.iter()
        .enumerate()
        .map(|(i, &s)| match (s, i.checked_sub(lead)) {
            (-1, Some(d)) => Ok(input[d]),
            (s, _) if s >= 0 => Ok(s as usize),
            _ => Err(Error::shape(format!(
                "cannot expand shape {input:?} to {size:?}"
            ))),
        })
        .collect()
}

/// A pooling call's `(kernel_size, stride)` at arguments 1 and 2; an empty
/// stride means the kernel size, as in PyTorch.
fn pool_window(a: &Args) -> Result<(Vec<usize>, Vec<usize>)> {
    let kernel = a.sizes(1)?;
    let stride = a.sizes(2)?;
    let stride = if stride.is_empty() {
        kernel.clone()
    } else {
        stride
    };
    Ok((kernel, stride))
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

/// The kernel of `name.overload`: the `aten::` kernels family by family,
/// then the other namespaces.
fn table(a: &Args, name: &str, overload: &str) -> Result<DecodedCall> {
    let Some(op) = name.strip_prefix("aten::") else {
        return other_namespace(a, name, overload);
    };
    let families: [Family; 10] = [
        elementwise,
        unary_with_attrs,
        binary_with_attrs,
        copies,
        reductions,
        norms,
        products_and_windows,
        indexing,
        layout,
        creation,
    ];
    for family in families {
        if let Some(call) = family(a, op, overload)? {
            return Ok(call);
        }
    }
    Err(unsupported(a))
}

/// The calls of one family of `aten::` kernels, by op name (`aten::`
/// dropped) and overload: `None` for another family's.
type Family = fn(&Args, &str, &str) -> Result<Option<DecodedCall>>;

/// Kernels outside `aten::`: EXIR's dim-order ops, `et_view`, and the
/// custom quantized and MoE calls.
fn other_namespace(a: &Args, name: &str, overload: &str) -> Result<DecodedCall> {
    match (name, overload) {
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
        // (self, size, out): a view, `out` planned at `self`'s bytes;
        // ExecuTorch emits it for the view/reshape of a dynamic tensor
        ("executorch_prim::et_view", "default" | "") => {
            reshape(a, 2, |x| view_shape(&a.ints(1)?, x))
        }
        ("dim_order_ops::_empty_dim_order", "out") => {
            contiguous_dim_order(a, 1)?;
            full(a, Scalar::Int(0), Some(0), 2)
        }
        _ => custom::decode(a, name, overload).unwrap_or_else(|| Err(unsupported(a))),
    }
}

/// The elementwise ops without attributes, from the op table: `(self, out)`
/// or `(self, other[, alpha], out)`.
fn elementwise(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    let call = match op_table::of_kernel(op, overload) {
        Some((Elementwise::Unary(u), _)) => unary(a, u, 1),
        Some((Elementwise::Binary(b, alpha), scalar)) => {
            let (alpha, out) = if alpha { (Some(2), 3) } else { (None, 2) };
            binary(a, b, scalar, alpha, out)
        }
        None => return Ok(None),
    };
    call.map(Some)
}

/// Unary ops with attributes (`gelu`'s approximation, clamps' bounds);
/// the rest are in the op table.
fn unary_with_attrs(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    use UnaryOp as U;
    let call = match (op, overload) {
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
        _ => return Ok(None),
    };
    call.map(Some)
}

/// Binary ops with attributes (a rounding mode, a scalar `self`, an
/// `alpha`), and `where`; the rest are in the op table.
fn binary_with_attrs(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    use BinaryOp as B;
    let call = match (op, overload) {
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
        _ => return Ok(None),
    };
    call.map(Some)
}

/// Copies and casts.
fn copies(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    let call = match (op, overload) {
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
        // (self, src, non_blocking, out = self): EXIR's write-back of a
        // mutated buffer at the end of the chain; the copy takes self's dtype
        ("copy_", "") => one(
            Op::Cast { dtype: a.dtype(3)? },
            vec![Some(a.tensor(1)?)],
            vec![a.tensor(3)?],
        ),
        _ => return Ok(None),
    };
    call.map(Some)
}

/// Reductions, scans, softmax and top-k.
fn reductions(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    let call = match (op, overload) {
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
        _ => return Ok(None),
    };
    call.map(Some)
}

/// Norms (extra statistics outputs are reported, not computed).
fn norms(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    let call = match (op, overload) {
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
        _ => return Ok(None),
    };
    call.map(Some)
}

/// Matrix products, convolution and pooling.
fn products_and_windows(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    let call = match (op, overload) {
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
            let op = Op::Convolution(ConvAttrs {
                stride: a.sizes(3)?,
                padding: a.sizes(4)?,
                dilation: a.sizes(5)?,
                transposed: a.bool(6)?,
                output_padding: a.sizes(7)?,
                groups,
            });
            one(
                op,
                vec![Some(a.tensor(0)?), Some(a.tensor(1)?), a.opt_tensor(2)?],
                vec![a.tensor(9)?],
            )
        }
        // (self, kernel_size, stride, padding, dilation, ceil_mode, out, indices)
        ("max_pool2d_with_indices", "out") => {
            let (kernel, stride) = pool_window(a)?;
            let op = Op::MaxPool(MaxPoolAttrs {
                stride,
                kernel,
                padding: a.sizes(3)?,
                dilation: a.sizes(4)?,
                ceil_mode: a.bool(5)?,
                with_indices: true,
            });
            one(
                op,
                vec![Some(a.tensor(0)?)],
                vec![a.tensor(6)?, a.tensor(7)?],
            )
        }
        // (self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override?, out)
        ("avg_pool2d", "out") => {
            let (kernel, stride) = pool_window(a)?;
            let op = Op::AvgPool(AvgPoolAttrs {
                stride,
                kernel,
                padding: a.sizes(3)?,
                ceil_mode: a.bool(4)?,
                count_include_pad: a.bool(5)?,
                divisor_override: a.opt_int(6)?,
            });
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
        _ => return Ok(None),
    };
    call.map(Some)
}

/// Gathers by index, and `tril`.
fn indexing(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    let call = match (op, overload) {
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
        _ => return Ok(None),
    };
    call.map(Some)
}

/// Layout (shapes are the out tensor's: `-1` sizes are resolved there).
fn layout(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    let call = match (op, overload) {
        // (self, size, out)
        ("view_copy", "out") => reshape(a, 2, |x| view_shape(&a.ints(1)?, x)),
        // (self, dim | dims, out)
        ("squeeze_copy", "dim_out" | "dims_out") => reshape(a, 2, |x| {
            let dims = match overload {
                "dim_out" => vec![a.int(1)?],
                _ => a.ints(1)?,
            };
            let dims = a.dims(&dims, 0)?;
            Ok(x.iter()
                .enumerate()
                .filter(|&(d, &s)| !(s == 1 && dims.contains(&d)))
                .map(|(_, &s)| s)
                .collect())
        }),
        ("unsqueeze_copy", "out") => reshape(a, 2, |x| {
            let mut shape = x.to_vec();
            shape.insert(normalize_dim(a.int(1)?, x.len() + 1)?, 1);
            Ok(shape)
        }),
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
            Op::Expand {
                shape: a.out_shape(3, || expand_shape(&a.ints(1)?, &a.shape(0)?))?,
            },
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
            split(a, dim, &a.tensor_list(3)?, |_| a.sizes(1))
        }
        // (self, split_size, dim, out Tensor[])
        ("split_copy", "Tensor_out") => {
            let dim = a.dim(2, 0)?;
            split(a, dim, &a.tensor_list(3)?, |size| {
                let piece = usize::try_from(a.int(1)?)
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| Error::format("split size must be positive"))?;
                Ok((0..size.div_ceil(piece).max(1))
                    .map(|k| piece.min(size - (k * piece).min(size)))
                    .collect())
            })
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
        _ => return Ok(None),
    };
    call.map(Some)
}

/// Creation: shape and dtype are the out tensor's.
fn creation(a: &Args, op: &str, overload: &str) -> Result<Option<DecodedCall>> {
    let call = match (op, overload) {
        // (size, fill_value, out)
        ("full", "out") => full(a, a.scalar(1)?, Some(0), 2),
        // (self, fill_value, memory_format?, out)
        ("full_like", "out") => full(a, a.scalar(1)?, None, 3),
        // (self, value, out)
        ("fill", "Scalar_out") => full(a, a.scalar(1)?, None, 2),
        // (size, out)
        ("zeros", "out") => full(a, Scalar::Int(0), Some(0), 1),
        ("ones", "out") => full(a, Scalar::Int(1), Some(0), 1),
        // (size, memory_format?, out): contents are unspecified; zeros are one choice
        ("empty", "out") => full(a, Scalar::Int(0), Some(0), 2),
        // (s, out)
        ("scalar_tensor", "out") => full(a, a.scalar(0)?, None, 1),
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
        _ => return Ok(None),
    };
    call.map(Some)
}

fn unsupported(a: &Args) -> Error {
    Error::unsupported(format!(
        "ExecuTorch operator {} has no etmetal kernel",
        a.name
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::TensorShapeDynamism;
    use etmetal_core::ErrorKind;

    /// A value table built by hand, as ExecuTorch's emitter lays it out.
    #[derive(Default)]
    struct Values(Vec<EValue>);

    impl Values {
        fn push(&mut self, v: EValue) -> i32 {
            self.0.push(v);
            self.0.len() as i32 - 1
        }
        fn t(&mut self, dtype: DType, sizes: &[i32]) -> i32 {
            self.push(EValue::Tensor(Tensor {
                scalar_type: dtype,
                storage_offset: 0,
                sizes: sizes.to_vec(),
                dim_order: (0..sizes.len() as u8).collect(),
                requires_grad: false,
                data_buffer_idx: 0,
                allocation_info: None,
                layout: 0,
                shape_dynamism: TensorShapeDynamism::Static,
                extra_tensor_info: None,
            }))
        }
        /// A DYNAMIC_BOUND f32 tensor: `sizes` are its current shape
        /// (the runtime keeps them so) or, for an out tensor, its bound.
        fn dynamic(&mut self, sizes: &[i32]) -> i32 {
            let v = self.f32(sizes);
            if let EValue::Tensor(t) = &mut self.0[v as usize] {
                t.shape_dynamism = TensorShapeDynamism::DynamicBound;
            }
            v
        }
        fn f32(&mut self, sizes: &[i32]) -> i32 {
            self.t(DType::F32, sizes)
        }
        fn int(&mut self, v: i64) -> i32 {
            self.push(EValue::Int(v))
        }
        fn ints(&mut self, v: &[i64]) -> i32 {
            let items = v.iter().map(|&x| self.int(x) as i64).collect();
            self.push(EValue::IntList(items))
        }
        fn float(&mut self, v: f64) -> i32 {
            self.push(EValue::Double(v))
        }
        fn bool(&mut self, v: bool) -> i32 {
            self.push(EValue::Bool(v))
        }
        fn null(&mut self) -> i32 {
            self.push(EValue::Null)
        }
        fn str(&mut self, s: &str) -> i32 {
            self.push(EValue::String(s.into()))
        }
        fn list(&mut self, items: &[i32]) -> i32 {
            self.push(EValue::TensorList(items.to_vec()))
        }
        fn call(&self, name: &str, args: &[i32]) -> Result<DecodedCall> {
            let (name, overload) = name.split_once('.').unwrap();
            let operator = Operator {
                name: name.into(),
                overload: overload.into(),
            };
            decode_call(&self.0, &operator, args)
        }
        /// The single op of a call, with its inputs and outputs as value indices.
        fn one(&self, name: &str, args: &[i32]) -> (Op, Vec<Option<usize>>, Vec<usize>) {
            let mut c = self.call(name, args).unwrap();
            assert_eq!(c.ops.len(), 1, "{name}");
            assert!(c.unwritten.is_empty(), "{name}");
            let d = c.ops.remove(0);
            (d.op, d.inputs, d.outputs)
        }
    }

    fn u(i: i32) -> usize {
        i as usize
    }

    #[test]
    fn unary_family() {
        let mut v = Values::default();
        let (x, out) = (v.f32(&[2, 3]), v.f32(&[2, 3]));
        let (op, ins, outs) = v.one("aten::relu.out", &[x, out, out]);
        assert_eq!(
            (op, ins, outs),
            (Op::Unary(UnaryOp::Relu), vec![Some(u(x))], vec![u(out)])
        );
        let tanh = v.str("tanh");
        assert_eq!(
            v.one("aten::gelu.out", &[x, tanh, out, out]).0,
            Op::Unary(UnaryOp::Gelu { tanh: true })
        );
        let (lo, hi) = (v.float(-0.5), v.float(0.75));
        let want = Op::Unary(UnaryOp::Clamp {
            min: Some(-0.5),
            max: Some(0.75),
        });
        assert_eq!(v.one("aten::hardtanh.out", &[x, lo, hi, out, out]).0, want);
        let none = v.null();
        let want = Op::Unary(UnaryOp::Clamp {
            min: None,
            max: Some(0.75),
        });
        assert_eq!(v.one("aten::clamp.out", &[x, none, hi, out, out]).0, want);
        let two = v.int(2);
        let want = Op::Unary(UnaryOp::PowScalar { exponent: 2.0 });
        assert_eq!(
            v.one("aten::pow.Tensor_Scalar_out", &[x, two, out, out]).0,
            want
        );
    }

    /// The quantized linears' custom calls, as `encode` writes them, read
    /// back as the op of their code width.
    #[test]
    fn quantized_linear_calls_round_trip() {
        use crate::kernels::encode::custom::encode;
        use crate::kernels::CallArg;
        use etmetal_core::quant::QuantFormat;
        for op in [
            QuantFormat::int4(64).linear_op(),
            QuantFormat::int8(640).linear_op(),
        ] {
            let mut v = Values::default();
            let (x, w) = (v.f32(&[1, 640]), v.t(DType::I32, &[8, 80]));
            let (s, z, out) = (v.f32(&[8, 1]), v.f32(&[8, 1]), v.f32(&[1, 8]));
            let call = encode(&op).unwrap().unwrap();
            // the encoder's argument list: inputs, the group, the out tensor
            let slots = [x, w, s, z];
            let args: Vec<i32> = call
                .args
                .iter()
                .map(|a| match a {
                    CallArg::Input(i) => slots[*i],
                    CallArg::Int(g) => v.int(*g),
                    _ => out,
                })
                .collect();
            let name = format!("{}.{}", call.name, call.overload);
            let (got, ins, outs) = v.one(&name, &args);
            assert_eq!(got, op, "{name}");
            assert_eq!(ins, slots.map(|i| Some(u(i))).to_vec());
            assert_eq!(outs, [u(out)]);
        }
    }

    #[test]
    fn binary_family_and_scalar_operands() {
        let mut v = Values::default();
        let (x, y, out) = (v.f32(&[2, 3]), v.f32(&[3]), v.f32(&[2, 3]));
        let (one, two, half) = (v.int(1), v.int(2), v.float(0.5));
        let (op, ins, _) = v.one("aten::add.out", &[x, y, one, out, out]);
        assert_eq!(
            (op, ins),
            (Op::Binary(BinaryOp::Add), vec![Some(u(x)), Some(u(y))])
        );
        let e = v.call("aten::sub.out", &[x, y, two, out, out]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(
            e.to_string().contains("aten::sub.out with alpha = 2"),
            "{e}"
        );
        // The scalar operand is the slot of its Double value.
        let (op, ins, _) = v.one("aten::mul.Scalar_out", &[x, half, out, out]);
        assert_eq!(
            (op, ins),
            (Op::Binary(BinaryOp::Mul), vec![Some(u(x)), Some(u(half))])
        );
        let (op, ins, _) = v.one("aten::rsub.Scalar_out", &[x, half, one, out, out]);
        assert_eq!(
            (op, ins),
            (Op::Binary(BinaryOp::Sub), vec![Some(u(half)), Some(u(x))])
        );
        let floor = v.str("floor");
        assert_eq!(
            v.one("aten::div.out_mode", &[x, y, floor, out, out]).0,
            Op::Binary(BinaryOp::FloorDiv)
        );
        let mask = v.t(DType::Bool, &[2, 3]);
        assert_eq!(
            v.one("aten::le.Scalar_out", &[x, two, mask, mask]).0,
            Op::Binary(BinaryOp::Le)
        );
        // A tensor where a scalar belongs is a format error naming the position.
        let e = v
            .call("aten::mul.Scalar_out", &[x, y, out, out])
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("argument 1: expected a scalar, got Tensor"),
            "{e}"
        );
    }

    #[test]
    fn where_and_masked_fill() {
        let mut v = Values::default();
        let (c, a, b, out) = (
            v.t(DType::Bool, &[3]),
            v.f32(&[3]),
            v.f32(&[3]),
            v.f32(&[3]),
        );
        let (op, ins, _) = v.one("aten::where.self_out", &[c, a, b, out, out]);
        assert_eq!(
            (op, ins),
            (Op::Where, vec![Some(u(c)), Some(u(a)), Some(u(b))])
        );
        let val = v.float(-1.0);
        let (op, ins, _) = v.one("aten::masked_fill.Scalar_out", &[a, c, val, out, out]);
        assert_eq!(
            (op, ins),
            (Op::Where, vec![Some(u(c)), Some(u(val)), Some(u(a))])
        );
    }

    #[test]
    fn reduction_family_normalises_dims() {
        let mut v = Values::default();
        let x = v.f32(&[3, 4, 5]);
        let (dims, keep, none) = (v.ints(&[-1, 0]), v.bool(true), v.null());
        let out = v.f32(&[1, 4, 1]);
        let want = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![2, 0],
            keepdim: true,
        };
        assert_eq!(
            v.one("aten::sum.IntList_out", &[x, dims, keep, none, out, out])
                .0,
            want
        );
        let want = Op::Reduce {
            op: ReduceOp::Mean,
            dims: vec![2, 0],
            keepdim: true,
        };
        assert_eq!(
            v.one("aten::mean.out", &[x, dims, keep, none, out, out]).0,
            want
        );
        let (d1, no) = (v.int(-2), v.bool(false));
        let b = v.t(DType::Bool, &[3, 5]);
        let want = Op::Reduce {
            op: ReduceOp::Any,
            dims: vec![1],
            keepdim: false,
        };
        assert_eq!(v.one("aten::any.out", &[x, d1, no, b, b]).0, want);
        let zero = v.int(0);
        let want = Op::Var {
            dims: vec![2, 0],
            correction: 0.0,
            keepdim: true,
        };
        assert_eq!(
            v.one("aten::var.correction_out", &[x, dims, zero, keep, out, out])
                .0,
            want
        );
        let idx = v.t(DType::I64, &[]);
        let want = Op::ArgReduce {
            max: true,
            dim: None,
            keepdim: false,
        };
        assert_eq!(v.one("aten::argmax.out", &[x, none, no, idx, idx]).0, want);
        let (vals, inds) = (v.f32(&[3, 5]), v.t(DType::I64, &[3, 5]));
        let list = v.list(&[vals, inds]);
        let (op, _, outs) = v.one("aten::max.dim_max", &[x, d1, no, vals, inds, list]);
        assert_eq!(
            op,
            Op::ReduceWithIndices {
                max: true,
                dim: 1,
                keepdim: false
            }
        );
        assert_eq!(outs, vec![u(vals), u(inds)]);
        let (last, no2) = (v.int(-1), v.bool(false));
        let want = Op::Softmax { dim: 2, log: true };
        assert_eq!(
            v.one("aten::_log_softmax.out", &[x, last, no2, x, x]).0,
            want
        );
    }

    #[test]
    fn norms_report_unwritten_statistics() {
        let mut v = Values::default();
        let (x, w) = (v.f32(&[2, 3, 12]), v.f32(&[12]));
        let (shape, none, eps) = (v.ints(&[12]), v.null(), v.float(1e-5));
        let (out, mean, rstd) = (v.f32(&[2, 3, 12]), v.f32(&[2, 3, 1]), v.f32(&[2, 3, 1]));
        let list = v.list(&[out, mean, rstd]);
        let c = v
            .call(
                "aten::native_layer_norm.out",
                &[x, shape, w, none, eps, out, mean, rstd, list],
            )
            .unwrap();
        assert_eq!(c.ops.len(), 1);
        assert_eq!(
            c.ops[0].op,
            Op::LayerNorm {
                normalized_dims: 1,
                eps: 1e-5
            }
        );
        assert_eq!(c.ops[0].inputs, vec![Some(u(x)), Some(u(w)), None]);
        assert_eq!(c.ops[0].outputs, vec![u(out)]);
        assert_eq!(c.unwritten, vec![u(mean), u(rstd)]);

        let (rm, rv, mom) = (v.f32(&[3]), v.f32(&[3]), v.float(0.1));
        let x4 = v.f32(&[2, 3, 4, 4]);
        let (o, s1, s2) = (v.f32(&[2, 3, 4, 4]), v.f32(&[0]), v.f32(&[0]));
        let c = v
            .call(
                "aten::_native_batch_norm_legit_no_training.out",
                &[x4, none, none, rm, rv, mom, eps, o, s1, s2],
            )
            .unwrap();
        assert_eq!(c.ops[0].op, Op::BatchNorm { eps: 1e-5 });
        assert_eq!(
            c.ops[0].inputs,
            vec![Some(u(x4)), None, None, Some(u(rm)), Some(u(rv))]
        );
        assert_eq!(c.unwritten, vec![u(s1), u(s2)]);
        // The single-op entry point still returns the op.
        let operator = Operator {
            name: "aten::native_layer_norm".into(),
            overload: "out".into(),
        };
        assert!(decode(
            &v.0,
            &operator,
            &[x, shape, w, none, eps, out, mean, rstd, list]
        )
        .is_ok());
    }

    #[test]
    fn matmul_conv_and_pool_family() {
        let mut v = Values::default();
        let (a, b, out) = (v.f32(&[4, 5]), v.f32(&[5, 2]), v.f32(&[4, 2]));
        assert_eq!(v.one("aten::mm.out", &[a, b, out, out]).0, Op::MatMul);
        let (bias, beta, alpha) = (v.f32(&[2]), v.float(0.5), v.int(1));
        let want = Op::Addmm {
            beta: 0.5,
            alpha: 1.0,
        };
        assert_eq!(
            v.one("aten::addmm.out", &[bias, a, b, beta, alpha, out, out])
                .0,
            want
        );

        let (x, w, none) = (v.f32(&[2, 4, 11, 11]), v.f32(&[8, 2, 3, 3]), v.null());
        let (st, pad, dil, tr, opad, groups) = (
            v.ints(&[2, 2]),
            v.ints(&[2, 2]),
            v.ints(&[2, 2]),
            v.bool(false),
            v.ints(&[0, 0]),
            v.int(2),
        );
        let y = v.f32(&[2, 8, 5, 5]);
        let (op, ins, _) = v.one(
            "aten::convolution.out",
            &[x, w, none, st, pad, dil, tr, opad, groups, y, y],
        );
        let want = Op::Convolution(ConvAttrs {
            stride: vec![2, 2],
            padding: vec![2, 2],
            dilation: vec![2, 2],
            transposed: false,
            output_padding: vec![0, 0],
            groups: 2,
        });
        assert_eq!((op, ins), (want, vec![Some(u(x)), Some(u(w)), None]));

        let (k, empty, p0, d1, ceil) = (
            v.ints(&[2, 2]),
            v.ints(&[]),
            v.ints(&[0, 0]),
            v.ints(&[1, 1]),
            v.bool(false),
        );
        let (pooled, idx) = (v.f32(&[2, 4, 5, 5]), v.t(DType::I64, &[2, 4, 5, 5]));
        let list = v.list(&[pooled, idx]);
        let (op, _, outs) = v.one(
            "aten::max_pool2d_with_indices.out",
            &[x, k, empty, p0, d1, ceil, pooled, idx, list],
        );
        let want = Op::MaxPool(MaxPoolAttrs {
            kernel: vec![2, 2],
            stride: vec![2, 2],
            padding: vec![0, 0],
            dilation: vec![1, 1],
            ceil_mode: false,
            with_indices: true,
        });
        assert_eq!((op, outs), (want, vec![u(pooled), u(idx)]));
        let (incl, none2) = (v.bool(true), v.null());
        let (op, _, _) = v.one(
            "aten::avg_pool2d.out",
            &[x, k, empty, p0, ceil, incl, none2, pooled, pooled],
        );
        assert!(
            matches!(op, Op::AvgPool(AvgPoolAttrs { ref stride, count_include_pad: true, divisor_override: None, .. }) if stride == &[2, 2])
        );
    }

    #[test]
    fn layout_family() {
        let mut v = Values::default();
        let x = v.f32(&[4, 6, 5]);
        let dims = v.ints(&[-1, 0, 1]);
        let y = v.f32(&[5, 4, 6]);
        assert_eq!(
            v.one("aten::permute_copy.out", &[x, dims, y, y]).0,
            Op::Permute {
                dims: vec![2, 0, 1]
            }
        );
        let (d0, d1) = (v.int(0), v.int(-1));
        let yt = v.f32(&[5, 6, 4]);
        assert_eq!(
            v.one("aten::transpose_copy.int_out", &[x, d0, d1, yt, yt])
                .0,
            Op::Permute {
                dims: vec![2, 1, 0]
            }
        );
        // Slice bounds clamp like PyTorch: start -100 → 0, end i64::MAX → 6.
        let (dim, start, end, step) = (v.int(1), v.int(-100), v.int(i64::MAX), v.int(2));
        let s = v.f32(&[4, 3, 5]);
        let want = Op::Slice {
            dim: 1,
            start: 0,
            end: 6,
            step: 2,
        };
        assert_eq!(
            v.one(
                "aten::slice_copy.Tensor_out",
                &[x, dim, start, end, step, s, s]
            )
            .0,
            want
        );
        let (none, three) = (v.null(), v.int(-3));
        let want = Op::Slice {
            dim: 1,
            start: 3,
            end: 6,
            step: 2,
        };
        assert_eq!(
            v.one(
                "aten::slice_copy.Tensor_out",
                &[x, dim, three, none, step, s, s]
            )
            .0,
            want
        );
        let (d2, last) = (v.int(2), v.int(-1));
        let sel = v.f32(&[4, 6]);
        assert_eq!(
            v.one("aten::select_copy.int_out", &[x, d2, last, sel, sel])
                .0,
            Op::Select { dim: 2, index: 4 }
        );
        let flat = v.f32(&[24, 5]);
        let size = v.ints(&[-1, 5]);
        assert_eq!(
            v.one("aten::view_copy.out", &[x, size, flat, flat]).0,
            Op::Reshape { shape: vec![24, 5] }
        );
        let (b, cd) = (v.f32(&[4, 2, 5]), v.int(-2));
        let items = v.list(&[x, b]);
        let c = v.f32(&[4, 8, 5]);
        let (op, ins, _) = v.one("aten::cat.out", &[items, cd, c, c]);
        assert_eq!(
            (op, ins),
            (Op::Cat { dim: 1 }, vec![Some(u(x)), Some(u(b))])
        );
        let (e, sz, implicit) = (
            v.f32(&[2, 4, 6, 5]),
            v.ints(&[2, -1, -1, -1]),
            v.bool(false),
        );
        assert_eq!(
            v.one("aten::expand_copy.out", &[x, sz, implicit, e, e]).0,
            Op::Expand {
                shape: vec![2, 4, 6, 5]
            }
        );
    }

    #[test]
    fn split_becomes_one_slice_per_piece() {
        let mut v = Values::default();
        let x = v.f32(&[4, 6]);
        let (sizes, dim) = (v.ints(&[1, 2, 3]), v.int(-1));
        let (a, b, c) = (v.f32(&[4, 1]), v.f32(&[4, 2]), v.f32(&[4, 3]));
        let outs = v.list(&[a, b, c]);
        let call = v
            .call(
                "aten::split_with_sizes_copy.out",
                &[x, sizes, dim, outs, outs],
            )
            .unwrap();
        let slices: Vec<_> = call
            .ops
            .iter()
            .map(|d| (d.op.clone(), d.outputs.clone()))
            .collect();
        assert_eq!(
            slices,
            vec![
                (
                    Op::Slice {
                        dim: 1,
                        start: 0,
                        end: 1,
                        step: 1
                    },
                    vec![u(a)]
                ),
                (
                    Op::Slice {
                        dim: 1,
                        start: 1,
                        end: 3,
                        step: 1
                    },
                    vec![u(b)]
                ),
                (
                    Op::Slice {
                        dim: 1,
                        start: 3,
                        end: 6,
                        step: 1
                    },
                    vec![u(c)]
                ),
            ]
        );
        let operator = Operator {
            name: "aten::split_with_sizes_copy".into(),
            overload: "out".into(),
        };
        let e = decode(&v.0, &operator, &[x, sizes, dim, outs, outs]).unwrap_err();
        assert!(e.to_string().contains("decodes to 3 ops"), "{e}");
    }

    #[test]
    fn creation_and_cast_family_take_the_out_tensor() {
        let mut v = Values::default();
        let x = v.f32(&[2, 3]);
        let (zero, fmt) = (v.int(0), v.int(1));
        let out = v.t(DType::I64, &[2, 3]);
        let want = Op::Full {
            shape: vec![2, 3],
            value: Scalar::Int(0),
            dtype: DType::I64,
        };
        assert_eq!(
            v.one("aten::full_like.out", &[x, zero, fmt, out, out]).0,
            want
        );
        let (s, e, st) = (v.int(0), v.int(7), v.int(1));
        let r = v.t(DType::I64, &[7]);
        let want = Op::Arange {
            start: Scalar::Int(0),
            end: Scalar::Int(7),
            step: Scalar::Int(1),
            dtype: DType::I64,
        };
        assert_eq!(v.one("aten::arange.start_out", &[s, e, st, r, r]).0, want);
        let ninf = v.float(f64::NEG_INFINITY);
        let t0 = v.f32(&[]);
        let want = Op::Full {
            shape: vec![],
            value: Scalar::Float(f64::NEG_INFINITY),
            dtype: DType::F32,
        };
        assert_eq!(v.one("aten::scalar_tensor.out", &[ninf, t0, t0]).0, want);
        let (nb, order) = (v.bool(false), v.ints(&[0, 1]));
        let h = v.t(DType::F16, &[2, 3]);
        let (op, ins, _) = v.one(
            "dim_order_ops::_to_dim_order_copy.out",
            &[x, nb, order, h, h],
        );
        assert_eq!(
            (op, ins),
            (Op::Cast { dtype: DType::F16 }, vec![Some(u(x))])
        );
        let swapped = v.ints(&[1, 0]);
        let e = v
            .call(
                "dim_order_ops::_clone_dim_order.out",
                &[x, nb, swapped, h, h],
            )
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("dim_order [1, 0]"), "{e}");
    }

    #[test]
    fn indexing_family() {
        let mut v = Values::default();
        let (x, i, j) = (
            v.f32(&[5, 6, 4]),
            v.t(DType::I64, &[3]),
            v.t(DType::I64, &[3]),
        );
        let list = v.push(EValue::OptionalTensorList(vec![-1, i]));
        let out = v.f32(&[5, 3, 4]);
        let (op, ins, _) = v.one("aten::index.Tensor_out", &[x, list, out, out]);
        assert_eq!((op, ins), (Op::Index, vec![Some(u(x)), None, Some(u(i))]));
        let d = v.int(-2);
        let (op, ins, _) = v.one("aten::index_select.out", &[x, d, j, out, out]);
        assert_eq!(
            (op, ins),
            (Op::IndexSelect { dim: 1 }, vec![Some(u(x)), Some(u(j))])
        );
        let (w, idx) = (v.f32(&[20, 8]), v.t(DType::I64, &[2, 5]));
        let (pad, f) = (v.int(-1), v.bool(false));
        let e = v.f32(&[2, 5, 8]);
        assert_eq!(
            v.one("aten::embedding.out", &[w, idx, pad, f, f, e, e]).1,
            vec![Some(u(w)), Some(u(idx))]
        );
    }

    #[test]
    fn malformed_and_unknown_calls_are_errors() {
        let mut v = Values::default();
        let x = v.f32(&[2]);
        let e = v.call("aten::frobnicate.out", &[x, x, x]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("aten::frobnicate.out"), "{e}");
        let e = v.call("aten::relu.out", &[x]).unwrap_err();
        assert!(
            e.to_string()
                .contains("aten::relu.out: argument 1 is missing"),
            "{e}"
        );
        let e = v.call("aten::relu.out", &[x, 99, 99]).unwrap_err();
        assert!(
            e.to_string().contains("value index 99 is out of range"),
            "{e}"
        );
        let bad_list = v.push(EValue::IntList(vec![x as i64]));
        let e = v
            .call("aten::permute_copy.out", &[x, bad_list, x, x])
            .unwrap_err();
        assert!(e.to_string().contains("is Tensor, not an Int"), "{e}");
        let (d, no) = (v.int(3), v.bool(false));
        let e = v.call("aten::_softmax.out", &[x, d, no, x, x]).unwrap_err();
        assert!(e.to_string().contains("dim 3 is out of range"), "{e}");
    }

    /// A dynamic out tensor's shape comes from the call's arguments and the
    /// inputs' current shapes, not from its planned bound.
    #[test]
    fn dynamic_outputs_take_the_shape_the_arguments_give() {
        let mut v = Values::default();
        // x is [3, 4] now (bound [8, 4]); the outs are planned at bounds
        let x = v.dynamic(&[3, 4]);
        let out = v.dynamic(&[32]);
        let size = v.ints(&[-1, 2]);
        assert_eq!(
            v.one("aten::view_copy.out", &[x, size, out, out]).0,
            Op::Reshape { shape: vec![6, 2] }
        );
        assert_eq!(
            v.one("executorch_prim::et_view.default", &[x, size, out]).0,
            Op::Reshape { shape: vec![6, 2] }
        );
        let bad = v.ints(&[5, -1]);
        let e = v
            .call("aten::view_copy.out", &[x, bad, out, out])
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Shape);
        assert!(
            e.to_string()
                .contains("cannot view a tensor of shape [3, 4] as [5, -1]"),
            "{e}"
        );

        let out3 = v.dynamic(&[2, 8, 4]);
        let size = v.ints(&[2, -1, 4]);
        let implicit = v.bool(false);
        assert_eq!(
            v.one("aten::expand_copy.out", &[x, size, implicit, out3, out3])
                .0,
            Op::Expand {
                shape: vec![2, 3, 4]
            }
        );
        let zero = v.int(0);
        assert_eq!(
            v.one("aten::unsqueeze_copy.out", &[x, zero, out3, out3]).0,
            Op::Reshape {
                shape: vec![1, 3, 4]
            }
        );
        let one = v.dynamic(&[1, 4]);
        let out2 = v.dynamic(&[8]);
        assert_eq!(
            v.one("aten::squeeze_copy.dim_out", &[one, zero, out2, out2])
                .0,
            Op::Reshape { shape: vec![4] }
        );
        let (sizes, fill) = (v.ints(&[3, 2]), v.float(1.5));
        assert_eq!(
            v.one("aten::full.out", &[sizes, fill, out3, out3]).0,
            Op::Full {
                shape: vec![3, 2],
                value: Scalar::Float(1.5),
                dtype: DType::F32
            }
        );
        let format = v.null();
        assert_eq!(
            v.one("aten::full_like.out", &[x, fill, format, out3, out3])
                .0,
            Op::Full {
                shape: vec![3, 4],
                value: Scalar::Float(1.5),
                dtype: DType::F32
            }
        );

        // split pieces from split_sizes / split_size, not the planned outs
        let (p0, p1) = (v.dynamic(&[8, 4]), v.dynamic(&[8, 4]));
        let pieces = v.list(&[p0, p1]);
        let (lens, dim0) = (v.ints(&[1, 2]), v.int(0));
        let c = v
            .call("aten::split_with_sizes_copy.out", &[x, lens, dim0, pieces])
            .unwrap();
        let slices: Vec<Op> = c.ops.into_iter().map(|d| d.op).collect();
        assert_eq!(
            slices,
            vec![
                Op::Slice {
                    dim: 0,
                    start: 0,
                    end: 1,
                    step: 1
                },
                Op::Slice {
                    dim: 0,
                    start: 1,
                    end: 3,
                    step: 1
                },
            ]
        );
        let two = v.int(2);
        let c = v
            .call("aten::split_copy.Tensor_out", &[x, two, dim0, pieces])
            .unwrap();
        assert_eq!(
            c.ops[1].op,
            Op::Slice {
                dim: 0,
                start: 2,
                end: 3,
                step: 1
            }
        );
        let three = v.int(3);
        let e = v
            .call("aten::split_copy.Tensor_out", &[x, three, dim0, pieces])
            .unwrap_err();
        assert!(e.to_string().contains("into 1 pieces has 2 outputs"), "{e}");
    }
}
