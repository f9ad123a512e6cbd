//! GPU kernels for scaled dot-product attention in one kernel with online softmax.
//! (Being written: until then these ops stay on the CPU.)

use etmetal_core::{Error, Op, Result};
use etmetal_graph::Node;

use crate::preprocess::Lowering;

/// Whether this module lowers `op`.
pub(super) fn takes(_op: &Op) -> bool {
    false
}

pub(super) fn lower(_lw: &mut Lowering, node: &Node) -> Result<()> {
    Err(Error::unsupported(format!(
        "{} has no GPU kernel yet",
        node.op.name()
    )))
}
// ops: Op::Sdpa { .. }
