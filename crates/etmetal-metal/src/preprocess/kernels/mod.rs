//! Kernel templates: the ops that are more than an expression per element.
//! Each reads its inputs as lazy values (`Lowering::input_view` for
//! operands read many times, `Lowering::fused` for operands read once),
//! writes `Lowering::output_buffer`s and appends dispatches. Which module
//! an op goes to is the op table's [`Form`] (`crate::op_table`).
//!
//! They import the lowering context (`super::lowering`), never the driver
//! (`super`), which calls [`lower`] for each node and hands the context
//! [`row_mean`] and [`scatter`] for the work it defers.

mod attention;
mod conv;
mod delta;
mod epilogue;
mod gemm;
mod glu;
mod int4;
mod matmul;
mod norm;
mod reduce;
mod rows;
mod scatter;
#[cfg(test)]
mod testing;
mod topk;

use etmetal_core::{Error, Result};
use etmetal_graph::Node;

pub use gemm::GEMM_COOP_VARIANTS;
pub(crate) use reduce::row_mean;
pub(crate) use scatter::dispatch as scatter;

use super::lowering::Lowering;
use crate::op_table::{form, Form};

pub(crate) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    match form(&node.op) {
        Some(Form::Reduce) => reduce::lower(lw, node),
        Some(Form::MatMul) => matmul::lower(lw, node),
        Some(Form::Conv) => conv::lower(lw, node),
        Some(Form::Norm) => norm::lower(lw, node),
        Some(Form::Attention) => attention::lower(lw, node),
        Some(Form::TopK) => topk::lower(lw, node),
        Some(Form::Quant) => int4::lower(lw, node),
        Some(Form::DeltaRule) => delta::lower(lw, node),
        Some(Form::Scatter) => scatter::lower(lw, node),
        Some(Form::Expression) | None => Err(Error::unsupported(format!(
            "{} has no GPU kernel yet",
            node.op.name()
        ))),
    }
}
