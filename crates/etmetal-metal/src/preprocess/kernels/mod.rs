//! Kernel templates: the ops that are more than an expression per element.
//! Each reads its inputs as lazy values (`Lowering::input_view` for
//! operands read many times, `Lowering::fused` for operands read once),
//! writes `Lowering::output_buffer`s and appends dispatches. Each module
//! says which ops it takes (`takes`), which the support table follows.

mod attention;
mod conv;
mod coop;
mod delta;
mod int4;
mod matmul;
mod norm;
mod reduce;
mod rows;
mod topk;

use etmetal_core::{Error, Op, Result};
use etmetal_graph::Node;

use super::Lowering;

/// Whether a kernel template lowers `op`.
pub(crate) fn takes(op: &Op) -> bool {
    reduce::takes(op)
        || matmul::takes(op)
        || conv::takes(op)
        || norm::takes(op)
        || attention::takes(op)
        || topk::takes(op)
        || int4::takes(op)
        || delta::takes(op)
}

pub(crate) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let op = &node.op;
    if reduce::takes(op) {
        reduce::lower(lw, node)
    } else if matmul::takes(op) {
        matmul::lower(lw, node)
    } else if conv::takes(op) {
        conv::lower(lw, node)
    } else if norm::takes(op) {
        norm::lower(lw, node)
    } else if attention::takes(op) {
        attention::lower(lw, node)
    } else if topk::takes(op) {
        topk::lower(lw, node)
    } else if int4::takes(op) {
        int4::lower(lw, node)
    } else if delta::takes(op) {
        delta::lower(lw, node)
    } else {
        Err(Error::unsupported(format!(
            "{} has no GPU kernel yet",
            op.name()
        )))
    }
}
