//! The etmetal graph IR and the passes on it: import from a torch.export
//! `.pt2` archive, shape and dtype inference, decompositions.

pub mod ir;

pub use ir::{Graph, InputKind, Node, OutputKind, ValueId, ValueInfo};
