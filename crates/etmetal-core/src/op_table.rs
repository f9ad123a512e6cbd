//! The op table, as tinygrad keeps its op set: the properties of the ops,
//! which the passes ask here instead of matching op names.
//!
//! - Every op has a [`Family`], which the passes that treat a family alike
//!   ask (shape inference has a module per family, the kernel-call encoder
//!   a function per family, the GPU partitioner takes int64 values by
//!   family).
//! - Per elementwise op without attributes: its name ([`crate::Op::name`],
//!   the `--skip-op` contract), the ATen ops the importer lowers to it, the
//!   ExecuTorch portable kernel that computes it, and its properties
//!   (bitwise, predicate: [`UnaryOp::is_bitwise`], [`BinaryOp::is_predicate`]
//!   and the like). The importer (`etmetal-graph::pt2`), the kernel-call
//!   encoder and decoder (`etmetal-pte::kernels`) and the passes asking a
//!   property read it here, so an op is added in one place. Ops with
//!   attributes (`gelu`'s approximation, `clamp`'s bounds, `div`'s rounding
//!   mode) are spelt out where they are read.
//! - ATen's in-place naming ([`functional_aten`]: `relu_` writes in place
//!   what `relu` returns), which the importer's functionalization and its
//!   hints read.

use crate::op::{BinaryOp, Op, UnaryOp};

/// The families of the op set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Unary and binary functions, `where`, casts and copies.
    Elementwise,
    /// Reductions over dims, and the ops that reduce or scan along one:
    /// variance, arg and indexed reductions, cumulative sum, softmax,
    /// top-k.
    Reduction,
    /// Network layers: norms, matrix products, convolution, pooling,
    /// attention.
    Layer,
    /// Ops that move or make values with no arithmetic on them: views and
    /// layout, gathers and writes by index, triangles, `full`, `arange`.
    Layout,
    /// etmetal's own ops beyond ATen's (ExecuTorch custom kernels):
    /// weight-only quantized linears, the MoE gather, the gated delta rule.
    Custom,
    /// A call into a backend's delegate.
    Delegate,
}

/// The family of `op`.
pub fn family(op: &Op) -> Family {
    match op {
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Identity => {
            Family::Elementwise
        }
        Op::Reduce { .. }
        | Op::Var { .. }
        | Op::ArgReduce { .. }
        | Op::ReduceWithIndices { .. }
        | Op::CumSum { .. }
        | Op::Softmax { .. }
        | Op::TopK { .. } => Family::Reduction,
        Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::BatchNorm { .. }
        | Op::GroupNorm { .. }
        | Op::MatMul
        | Op::Addmm { .. }
        | Op::Linear
        | Op::Convolution(_)
        | Op::MaxPool(_)
        | Op::AvgPool(_)
        | Op::AdaptiveAvgPool { .. }
        | Op::Sdpa { .. } => Family::Layer,
        Op::Embedding
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Select { .. }
        | Op::Cat { .. }
        | Op::ConstantPad { .. }
        | Op::IndexSelect { .. }
        | Op::Gather { .. }
        | Op::IndexCopy { .. }
        | Op::Index
        | Op::Triangle { .. }
        | Op::Repeat { .. }
        | Op::Full { .. }
        | Op::Arange { .. } => Family::Layout,
        Op::Int4Linear { .. }
        | Op::Int8Linear { .. }
        | Op::GatherQmv { .. }
        | Op::GatedDeltaRule => Family::Custom,
        Op::Delegate { .. } => Family::Delegate,
    }
}

/// An ExecuTorch portable out-variant kernel computing an elementwise op:
/// `aten::<name>.<tensor>` with tensor operands, and `aten::<name>.<scalar>`
/// where the last operand is a Python scalar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    pub name: &'static str,
    pub tensor: &'static str,
    /// The overload whose `other` is a scalar, if the kernel has one.
    pub scalar: Option<&'static str>,
    /// Whether an `alpha` scalar (always 1 here) follows the operands.
    pub alpha: bool,
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct Row<T> {
    pub op: T,
    /// etmetal's name: keep these strings stable.
    pub name: &'static str,
    /// The `torch.ops.aten` ops (overload aside) the importer lowers to
    /// this op alone.
    pub aten: &'static [&'static str],
    /// The portable kernel writing it, if one does without attributes.
    pub kernel: Option<Kernel>,
    /// Works on bits: integer and bool tensors only.
    pub bitwise: bool,
    /// Gives bool whatever its inputs.
    pub predicate: bool,
}

const fn kernel(name: &'static str, tensor: &'static str) -> Option<Kernel> {
    Some(Kernel {
        name,
        tensor,
        scalar: None,
        alpha: false,
    })
}

const fn with_scalar(
    name: &'static str,
    tensor: &'static str,
    scalar: &'static str,
) -> Option<Kernel> {
    Some(Kernel {
        name,
        tensor,
        scalar: Some(scalar),
        alpha: false,
    })
}

const fn unary(op: UnaryOp, name: &'static str, portable: bool) -> Row<UnaryOp> {
    Row {
        op,
        name,
        aten: &[],
        kernel: if portable { kernel(name, "out") } else { None },
        bitwise: matches!(op, UnaryOp::BitwiseNot),
        predicate: matches!(op, UnaryOp::LogicalNot),
    }
}

/// Unary ops without attributes; each is the ATen op of its name. Those
/// with no portable kernel (`silu`, `hardswish`, `hardsigmoid`) are
/// rewritten by `to_portable`.
pub const UNARY: &[Row<UnaryOp>] = &[
    unary(UnaryOp::Relu, "relu", true),
    unary(UnaryOp::Silu, "silu", false),
    unary(UnaryOp::Sigmoid, "sigmoid", true),
    unary(UnaryOp::Tanh, "tanh", true),
    unary(UnaryOp::Exp, "exp", true),
    unary(UnaryOp::Log, "log", true),
    unary(UnaryOp::Sqrt, "sqrt", true),
    unary(UnaryOp::Rsqrt, "rsqrt", true),
    unary(UnaryOp::Neg, "neg", true),
    unary(UnaryOp::Abs, "abs", true),
    unary(UnaryOp::Reciprocal, "reciprocal", true),
    unary(UnaryOp::Sin, "sin", true),
    unary(UnaryOp::Cos, "cos", true),
    unary(UnaryOp::Erf, "erf", true),
    unary(UnaryOp::Floor, "floor", true),
    unary(UnaryOp::Ceil, "ceil", true),
    unary(UnaryOp::Round, "round", true),
    unary(UnaryOp::Sign, "sign", true),
    unary(UnaryOp::Hardswish, "hardswish", false),
    unary(UnaryOp::Hardsigmoid, "hardsigmoid", false),
    unary(UnaryOp::LogicalNot, "logical_not", true),
    unary(UnaryOp::BitwiseNot, "bitwise_not", true),
];

const fn binary(
    op: BinaryOp,
    name: &'static str,
    aten: &'static [&'static str],
    kernel: Option<Kernel>,
) -> Row<BinaryOp> {
    use BinaryOp::*;
    Row {
        op,
        name,
        aten,
        kernel,
        bitwise: matches!(op, BitwiseAnd | BitwiseOr | BitwiseXor),
        predicate: matches!(
            op,
            Eq | Ne | Lt | Le | Gt | Ge | LogicalAnd | LogicalOr | LogicalXor
        ),
    }
}

/// `add`/`sub`: with the `alpha` of `a + alpha * b`.
const fn with_alpha(name: &'static str) -> Option<Kernel> {
    Some(Kernel {
        name,
        tensor: "out",
        scalar: Some("Scalar_out"),
        alpha: true,
    })
}

/// Binary ops. `div` (its rounding mode picks the op), `floor_div` and
/// `trunc_div` (`div.out_mode` with the mode) and `pow` of a scalar base
/// are read where their attributes are.
pub const BINARY: &[Row<BinaryOp>] = &[
    binary(BinaryOp::Add, "add", &["add"], with_alpha("add")),
    binary(BinaryOp::Sub, "sub", &["sub"], with_alpha("sub")),
    binary(
        BinaryOp::Mul,
        "mul",
        &["mul"],
        with_scalar("mul", "out", "Scalar_out"),
    ),
    binary(
        BinaryOp::Div,
        "div",
        &[],
        with_scalar("div", "out", "Scalar_out"),
    ),
    binary(BinaryOp::FloorDiv, "floor_div", &["floor_divide"], None),
    binary(BinaryOp::TruncDiv, "trunc_div", &[], None),
    binary(
        BinaryOp::Remainder,
        "remainder",
        &["remainder"],
        with_scalar("remainder", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::Pow,
        "pow",
        &["pow"],
        kernel("pow", "Tensor_Tensor_out"),
    ),
    binary(
        BinaryOp::Maximum,
        "maximum",
        &["maximum"],
        kernel("maximum", "out"),
    ),
    binary(
        BinaryOp::Minimum,
        "minimum",
        &["minimum"],
        kernel("minimum", "out"),
    ),
    binary(
        BinaryOp::Eq,
        "eq",
        &["eq"],
        with_scalar("eq", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::Ne,
        "ne",
        &["ne"],
        with_scalar("ne", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::Lt,
        "lt",
        &["lt"],
        with_scalar("lt", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::Le,
        "le",
        &["le"],
        with_scalar("le", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::Gt,
        "gt",
        &["gt"],
        with_scalar("gt", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::Ge,
        "ge",
        &["ge"],
        with_scalar("ge", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::LogicalAnd,
        "logical_and",
        &["logical_and"],
        kernel("logical_and", "out"),
    ),
    binary(
        BinaryOp::LogicalOr,
        "logical_or",
        &["logical_or"],
        kernel("logical_or", "out"),
    ),
    binary(
        BinaryOp::LogicalXor,
        "logical_xor",
        &["logical_xor"],
        kernel("logical_xor", "out"),
    ),
    binary(
        BinaryOp::BitwiseAnd,
        "bitwise_and",
        &["bitwise_and", "__and__"],
        with_scalar("bitwise_and", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::BitwiseOr,
        "bitwise_or",
        &["bitwise_or", "__or__"],
        with_scalar("bitwise_or", "Tensor_out", "Scalar_out"),
    ),
    binary(
        BinaryOp::BitwiseXor,
        "bitwise_xor",
        &["bitwise_xor", "__xor__"],
        with_scalar("bitwise_xor", "Tensor_out", "Scalar_out"),
    ),
];

/// The row of `u`, if `u` has no attributes.
pub fn unary_row(u: UnaryOp) -> Option<&'static Row<UnaryOp>> {
    UNARY.iter().find(|r| r.op == u)
}

/// The row of `b` (every binary op has one).
pub fn binary_row(b: BinaryOp) -> &'static Row<BinaryOp> {
    BINARY
        .iter()
        .find(|r| r.op == b)
        .expect("every BinaryOp has a row in BINARY (tested)")
}

/// The unary op the ATen op `aten` lowers to, if it has no attributes.
pub fn unary_of_aten(aten: &str) -> Option<UnaryOp> {
    UNARY.iter().find(|r| r.name == aten).map(|r| r.op)
}

/// The binary op the ATen op `aten` lowers to, where its name alone says.
pub fn binary_of_aten(aten: &str) -> Option<BinaryOp> {
    BINARY.iter().find(|r| r.aten.contains(&aten)).map(|r| r.op)
}

/// The functional ATen op of an in-place one (`relu_` → `relu`): the name
/// less its trailing `_`. `None` for a name that does not write in place
/// (`relu`; `__and__` and friends end in `_` without writing in place).
pub fn functional_aten(name: &str) -> Option<&str> {
    name.strip_suffix('_')
        .filter(|b| !b.is_empty() && !b.ends_with('_'))
}

/// The op a portable kernel call `aten::<name>.<overload>` computes, with
/// whether its `other` is a scalar: unary ops first, then binary ones.
pub fn of_kernel(name: &str, overload: &str) -> Option<(Elementwise, bool)> {
    let plain = |k: &Kernel| k.name == name;
    if overload == "out" {
        if let Some(r) = UNARY.iter().find(|r| r.kernel.as_ref().is_some_and(plain)) {
            return Some((Elementwise::Unary(r.op), false));
        }
    }
    BINARY.iter().find_map(|r| {
        let k = r.kernel.as_ref().filter(|k| plain(k))?;
        if k.tensor == overload {
            Some((Elementwise::Binary(r.op, k.alpha), false))
        } else if k.scalar == Some(overload) {
            Some((Elementwise::Binary(r.op, k.alpha), true))
        } else {
            None
        }
    })
}

/// Names and properties of the elementwise ops, read from their rows.
impl UnaryOp {
    /// The op's name ([`Op::name`]): the op table's, or the name of an op
    /// with attributes.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Gelu { .. } => "gelu",
            UnaryOp::LeakyRelu { .. } => "leaky_relu",
            UnaryOp::Clamp { .. } => "clamp",
            UnaryOp::PowScalar { .. } => "pow_scalar",
            u => {
                unary_row(u)
                    .expect("every unary op without attributes has a row (tested)")
                    .name
            }
        }
    }

    /// Whether the result is bool whatever the input.
    pub fn is_predicate(self) -> bool {
        unary_row(self).is_some_and(|r| r.predicate)
    }

    /// Whether the op works on bits (integer and bool tensors only).
    pub fn is_bitwise(self) -> bool {
        unary_row(self).is_some_and(|r| r.bitwise)
    }
}

impl BinaryOp {
    /// The op's name ([`Op::name`]), from the op table.
    pub fn name(self) -> &'static str {
        binary_row(self).name
    }

    /// Whether the result is bool regardless of the inputs.
    pub fn is_predicate(self) -> bool {
        binary_row(self).predicate
    }

    /// Whether the op works on bits (integer and bool tensors only).
    pub fn is_bitwise(self) -> bool {
        binary_row(self).bitwise
    }
}

/// What [`of_kernel`] found: a unary op, or a binary op and whether its
/// kernel takes an `alpha`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Elementwise {
    Unary(UnaryOp),
    Binary(BinaryOp, bool),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_names_give_their_functional_op() {
        assert_eq!(functional_aten("relu_"), Some("relu"));
        assert_eq!(functional_aten("index_put_"), Some("index_put"));
        assert_eq!(functional_aten("relu"), None);
        assert_eq!(functional_aten("__and__"), None);
        assert_eq!(functional_aten("_"), None);
    }

    #[test]
    fn unary_properties_are_the_rows() {
        assert!(UnaryOp::BitwiseNot.is_bitwise() && !UnaryOp::BitwiseNot.is_predicate());
        assert!(UnaryOp::LogicalNot.is_predicate() && !UnaryOp::LogicalNot.is_bitwise());
        let clamp = UnaryOp::Clamp {
            min: None,
            max: None,
        };
        for u in [UnaryOp::Relu, UnaryOp::Neg, clamp] {
            assert!(!u.is_bitwise() && !u.is_predicate(), "{u:?}");
        }
    }

    #[test]
    fn every_binary_op_has_one_row_and_names_are_unique() {
        let mut names: Vec<&str> = UNARY.iter().map(|r| r.name).collect();
        names.extend(BINARY.iter().map(|r| r.name));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a name is given twice");
        for (i, r) in BINARY.iter().enumerate() {
            assert!(BINARY[..i].iter().all(|o| o.op != r.op), "{} twice", r.name);
            assert_eq!(binary_row(r.op).name, r.name);
        }
        // each portable kernel overload decodes to one op
        for r in BINARY {
            if let Some(k) = r.kernel {
                assert_eq!(
                    of_kernel(k.name, k.tensor),
                    Some((Elementwise::Binary(r.op, k.alpha), false))
                );
            }
        }
    }
}
