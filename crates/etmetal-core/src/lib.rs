//! Types shared by every etmetal crate: element types, shapes, host tensors,
//! the typed operator set and the error type.
//!
//! It is also the one home of the PyTorch rules that more than one crate
//! applies: type promotion ([`dtype::result_type`]), the output sizes of
//! convolutions and pools ([`shape::conv_output_size`],
//! [`shape::pool_output_size`], through [`ConvAttrs`] and [`PoolWindow`])
//! and grouped-query attention heads ([`shape::attention_batch`]).
//!
//! Nothing here knows about files, graphs or devices; the compiler and the
//! runtime both build on these definitions so that an op means the same thing
//! on every side of the `.pte` boundary.

pub mod dtype;
pub mod error;
pub mod npy;
pub mod op;
pub mod op_table;
pub mod quant;
pub mod shape;
pub mod spec;
pub mod sym;
pub mod tensor;

pub use dtype::{DType, Scalar};
pub use error::{Error, ErrorKind, Result};
pub use op::{AvgPoolAttrs, BinaryOp, ConvAttrs, MaxPoolAttrs, Op, PoolWindow, ReduceOp, UnaryOp};
pub use spec::{check_inputs, TensorSpec};
pub use sym::{SymExpr, SymRange, SymRanges};
pub use tensor::{Tensor, View, ViewMut};
