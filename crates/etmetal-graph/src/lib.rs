//! The etmetal graph IR and the passes on it: import from a torch.export
//! `.pt2` archive, shape and dtype inference, decompositions, folding, and
//! the graph's evaluation node by node on the CPU kernels (`eval`).

pub mod decompose;
pub mod eval;
pub mod fold;
pub mod infer;
pub mod infer_sym;
pub mod ir;
pub mod plan;
pub mod portable;
pub mod precision;
pub mod pt2;
pub mod quantize;
mod rewrite;
pub mod siblings;
#[cfg(test)]
mod test_util;

pub use decompose::{decompose, eliminate_dead_code};
pub use fold::{fold_constants, fold_conv_affine};
pub use infer::infer;
pub use infer_sym::{assign_sym, infer_sym};
pub use ir::{Graph, InputKind, Node, OutputKind, SymShapes, ValueId, ValueInfo};
pub use pt2::{import_pt2, load_pt2};
