//! ExecuTorch's operator calling conventions: how an [`Op`] is written as a
//! `KernelCall` of an out-variant ATen kernel (`aten::add.out` with
//! `self, other, alpha, out, ret`), and how such a call is read back.
//!
//! [`encode`] (compiler side) and [`decode`] (runtime side) are the two
//! directions of one table; `decode(encode(op)) == op` is tested for every
//! op both support.

mod decode;
mod encode;
mod sym;

pub use decode::{decode, decode_call, DecodedCall};
pub use encode::{encode, kernel_outputs};
pub use sym::{decode_sym, Prim, SymCall};

use etmetal_core::{DType, Op, Scalar};

/// One argument of a kernel call, in the out-variant schema's order.
#[derive(Clone, Debug, PartialEq)]
pub enum CallArg {
    /// The op's input slot `i` (a tensor).
    Input(usize),
    /// An absent optional tensor (written as `Null`).
    NoTensor,
    /// A `Tensor[]` argument made of input slots (`cat`).
    InputList(Vec<usize>),
    /// A `Tensor?[]` argument (`index.Tensor`); `None` is an absent index.
    OptionalInputList(Vec<Option<usize>>),
    /// The op's output `i`, passed as an `out` argument. ExecuTorch appends
    /// the returned tensor(s) after the schema arguments again: the encoder
    /// lists them explicitly, so `args` is the complete `KernelCall.args`.
    Output(usize),
    /// The returned tuple of a multi-output kernel (`max.dim_max`,
    /// `native_layer_norm.out`): EXIR writes it as one `TensorList` of the
    /// out tensors after the out arguments.
    OutputList(Vec<usize>),
    Null,
    Int(i64),
    /// `int[]` (boxed in the file: an `IntList` of `Int` values).
    Ints(Vec<i64>),
    Float(f64),
    Floats(Vec<f64>),
    Bool(bool),
    Bools(Vec<bool>),
    Str(String),
    Scalar(Scalar),
    ScalarType(DType),
}

/// A kernel call of ExecuTorch's: operator name, overload and arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// Qualified name, e.g. `"aten::add"`.
    pub name: String,
    /// Overload, e.g. `"out"`.
    pub overload: String,
    pub args: Vec<CallArg>,
}

/// Dtype and shape of a tensor argument, for conventions that depend on it.
pub type TensorMeta = (DType, Vec<usize>);

/// A decoded call: the op, the values holding its input slots (`None`: an
/// absent optional tensor; a `Tensor[]` argument contributes one slot per
/// item) and the values it writes, all as indices into the plan's `values`.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoded {
    pub op: Op,
    pub inputs: Vec<Option<usize>>,
    pub outputs: Vec<usize>,
}
