//! Which ops preprocess lowers, and with what: the one table that the
//! partitioner's support check and preprocess's dispatch both read, so the
//! partitioner need not ask preprocess (which reads its partitions). By op
//! kind only: conditions on attributes, dtypes and shapes, with the reasons
//! a node stays on the CPU, are the partitioner's (`partitioner::support`).

use etmetal_core::Op;

/// How preprocess lowers an op: as a lazy expression fused into its
/// readers, or by one of the kernel templates (`preprocess::kernels`, a
/// module each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    Expression,
    Reduce,
    MatMul,
    Conv,
    Norm,
    Attention,
    TopK,
    /// Weight-only quantized linears (int4, int8) and the int4 MoE gather
    /// (`kernels/int4.rs`).
    Quant,
    /// Qwen3.5's gated delta rule (`kernels/delta.rs`).
    DeltaRule,
    /// Rows written at an index tensor's positions (`kernels/scatter.rs`).
    Scatter,
}

/// The form `op` is lowered in; `None`: it has no GPU form.
pub(crate) fn form(op: &Op) -> Option<Form> {
    Some(match op {
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Cast { .. }
        | Op::Identity
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Select { .. }
        | Op::Repeat { .. }
        | Op::Cat { .. }
        | Op::ConstantPad { .. }
        | Op::Triangle { .. }
        | Op::Full { .. }
        | Op::Arange { .. }
        | Op::Embedding
        | Op::IndexSelect { .. }
        | Op::Gather { .. } => Form::Expression,
        Op::Reduce { .. }
        | Op::Var { .. }
        | Op::ArgReduce { .. }
        | Op::ReduceWithIndices { .. }
        | Op::Softmax { .. } => Form::Reduce,
        Op::MatMul | Op::Addmm { .. } | Op::Linear => Form::MatMul,
        Op::Convolution { .. }
        | Op::MaxPool { .. }
        | Op::AvgPool { .. }
        | Op::AdaptiveAvgPool { .. } => Form::Conv,
        Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::BatchNorm { .. } | Op::GroupNorm { .. } => {
            Form::Norm
        }
        Op::Sdpa { .. } => Form::Attention,
        Op::TopK { .. } | Op::CumSum { .. } | Op::Index => Form::TopK,
        Op::Int4Linear { .. } | Op::Int8Linear { .. } | Op::GatherQmv { .. } => Form::Quant,
        Op::GatedDeltaRule => Form::DeltaRule,
        Op::IndexCopy { .. } => Form::Scatter,
        _ => return None,
    })
}
