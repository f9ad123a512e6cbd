//! The operator-support table of the Metal backend: which nodes its GPU
//! kernels take. What is refused stays on the CPU, so every refusal carries
//! a reason for `inspect` and for `--partition whole` errors.
//!
//! The table is what the first GPU kernels implement: pointwise and
//! broadcast ops, reductions, softmax, norms, matmul/linear/addmm,
//! 1-D/2-D convolution and pooling, SDPA, layout ops, embedding and
//! gathers, where, full/arange and casts. Floats are computed in f32, bf16
//! or f16; WGSL has no 64-bit integers, so int64 tensors are only moved
//! (layout, indexing, casts, full/arange) or written as indices, never
//! computed on.

use etmetal_core::{BinaryOp, DType, Op, ReduceOp, Scalar, UnaryOp};
use etmetal_graph::{Graph, Node, ValueInfo};

/// Device limits a node must fit. The defaults are wgpu's default limits,
/// which every Metal, Vulkan and DX12 adapter meets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Largest tensor, in bytes (wgpu's `max_storage_buffer_binding_size`).
    pub max_buffer_bytes: u64,
    /// Largest rank the kernels' shape parameters hold.
    pub max_rank: usize,
    /// Largest `k` of top-k (kept in one workgroup's registers).
    pub max_topk: usize,
    /// Largest head dim of attention (one row of q in workgroup memory).
    pub max_head_dim: usize,
}

impl Default for DeviceLimits {
    fn default() -> Self {
        DeviceLimits {
            max_buffer_bytes: 128 << 20,
            max_rank: 8,
            max_topk: 256,
            max_head_dim: 256,
        }
    }
}

/// Whether the backend takes an op at all, from its kind and attributes
/// alone (no dtypes or shapes). [`supports`] adds the per-node conditions.
pub fn op_supported(op: &Op) -> Result<(), String> {
    let spatial = |n: usize, what: &str| {
        if (1..=2).contains(&n) {
            Ok(())
        } else {
            Err(format!("{n}-D {what} (the GPU kernels do 1-D and 2-D)"))
        }
    };
    match op {
        Op::CumSum { .. } => Err("cumsum (a scan) has no GPU kernel yet".into()),
        Op::Convolution {
            transposed: true, ..
        } => Err("transposed convolution has no GPU kernel yet".into()),
        Op::Convolution { stride, .. } => spatial(stride.len(), "convolution"),
        Op::MaxPool {
            with_indices: true, ..
        } => Err("max pooling with indices has no GPU kernel yet".into()),
        Op::MaxPool { kernel, .. } | Op::AvgPool { kernel, .. } => spatial(kernel.len(), "pooling"),
        Op::AdaptiveAvgPool { output_size } => spatial(output_size.len(), "adaptive pooling"),
        _ => Ok(()),
    }
}

/// Whether the Metal backend takes `node` of `graph` within `limits`;
/// `Err` holds the reason it stays on the CPU.
pub fn supports(graph: &Graph, node: &Node, limits: &DeviceLimits) -> Result<(), String> {
    op_supported(&node.op)?;
    let info = |id: etmetal_graph::ValueId| {
        graph
            .values
            .get(id.0)
            .ok_or_else(|| format!("refers to value #{} which is not in the graph", id.0))
    };
    let ins = node
        .inputs
        .iter()
        .map(|slot| slot.map(info).transpose())
        .collect::<Result<Vec<_>, _>>()?;
    let outs = node
        .outputs
        .iter()
        .map(|v| info(*v))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, v) in ins.iter().enumerate() {
        if let Some(v) = v {
            storable(v, limits).map_err(|e| format!("input {i}: {e}"))?;
            if v.dtype == DType::I64 && !moves_bytes(&node.op) {
                return Err(format!("input {i} is int64 (WGSL has no 64-bit integers)"));
            }
        }
    }
    for (i, v) in outs.iter().enumerate() {
        storable(v, limits).map_err(|e| format!("output {i}: {e}"))?;
        if v.shape.contains(&0) {
            return Err(format!("output {i} is empty ({:?})", v.shape));
        }
        if v.dtype == DType::I64 && !moves_bytes(&node.op) && !is_index_output(&node.op, i) {
            return Err(format!("output {i} is int64 (WGSL has no 64-bit integers)"));
        }
    }
    dtypes_taken(&node.op, &ins, limits)
}

/// The storage dtypes of GPU buffers.
const STORED: [DType; 6] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::I32,
    DType::Bool,
];

fn storable(v: &ValueInfo, limits: &DeviceLimits) -> Result<(), String> {
    if !STORED.contains(&v.dtype) {
        return Err(format!(
            "`{}` is {} (the GPU takes float32/bfloat16/float16, int64/int32/bool)",
            v.name,
            v.dtype.name()
        ));
    }
    if v.shape.len() > limits.max_rank {
        return Err(format!(
            "`{}` has rank {} (at most {})",
            v.name,
            v.shape.len(),
            limits.max_rank
        ));
    }
    let bytes = v
        .shape
        .iter()
        .try_fold(v.dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64));
    match bytes {
        Some(b) if b <= limits.max_buffer_bytes => Ok(()),
        _ => Err(format!(
            "`{}` of shape {:?} exceeds the {} byte buffer limit",
            v.name, v.shape, limits.max_buffer_bytes
        )),
    }
}

/// Ops whose kernels copy or write elements without arithmetic on them, so
/// int64 travels as two 32-bit words.
fn moves_bytes(op: &Op) -> bool {
    matches!(
        op,
        Op::Identity
            | Op::Cast { .. }
            | Op::Where
            | Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::Expand { .. }
            | Op::Slice { .. }
            | Op::Select { .. }
            | Op::Cat { .. }
            | Op::ConstantPad { .. }
            | Op::Repeat { .. }
            | Op::Triangle { .. }
            | Op::Embedding
            | Op::IndexSelect { .. }
            | Op::Gather { .. }
            | Op::Index
            | Op::Full { .. }
            | Op::Arange { .. }
    )
}

/// Outputs that hold int64 indices written by a float kernel.
fn is_index_output(op: &Op, slot: usize) -> bool {
    match op {
        Op::ArgReduce { .. } => slot == 0,
        Op::ReduceWithIndices { .. } | Op::TopK { .. } => slot == 1,
        _ => false,
    }
}

fn is_gpu_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

fn float(v: &ValueInfo, slot: usize) -> Result<(), String> {
    if is_gpu_float(v.dtype) {
        Ok(())
    } else {
        Err(format!(
            "input {slot} is {} (this op runs on float32/bfloat16/float16)",
            v.dtype.name()
        ))
    }
}

fn integer_index(v: &ValueInfo, slot: usize) -> Result<(), String> {
    match v.dtype {
        DType::I64 | DType::I32 => Ok(()),
        DType::Bool => Err(format!(
            "input {slot} is a bool mask index (its result shape depends on the data)"
        )),
        d => Err(format!(
            "input {slot} is a {} index (int64/int32 expected)",
            d.name()
        )),
    }
}

/// Input `slot`, which the op requires.
fn required<'a>(ins: &[Option<&'a ValueInfo>], slot: usize) -> Result<&'a ValueInfo, String> {
    ins.get(slot)
        .copied()
        .flatten()
        .ok_or_else(|| format!("required input {slot} is missing"))
}

/// Every present input of `slots` is float, all of one dtype.
fn same_float(ins: &[Option<&ValueInfo>], slots: std::ops::Range<usize>) -> Result<(), String> {
    let mut first: Option<DType> = None;
    for slot in slots {
        let Some(v) = ins.get(slot).copied().flatten() else {
            continue;
        };
        float(v, slot)?;
        match first {
            Some(d) if d != v.dtype => {
                return Err(format!(
                    "mixed dtypes {} and {} (the kernels take one float dtype)",
                    d.name(),
                    v.dtype.name()
                ))
            }
            _ => first = Some(v.dtype),
        }
    }
    Ok(())
}

/// The per-op dtype and size conditions.
fn dtypes_taken(op: &Op, ins: &[Option<&ValueInfo>], limits: &DeviceLimits) -> Result<(), String> {
    let all = 0..ins.len();
    match op {
        Op::Unary(u) => {
            let x = required(ins, 0)?;
            match u {
                UnaryOp::Relu
                | UnaryOp::Neg
                | UnaryOp::Abs
                | UnaryOp::Sign
                | UnaryOp::Clamp { .. }
                | UnaryOp::LogicalNot
                    if x.dtype == DType::I32 || x.dtype == DType::Bool =>
                {
                    Ok(())
                }
                UnaryOp::LogicalNot => Ok(()),
                UnaryOp::BitwiseNot => match x.dtype {
                    DType::I32 | DType::Bool => Ok(()),
                    d => Err(format!("bitwise_not of {}", d.name())),
                },
                _ => float(x, 0),
            }
        }
        Op::Binary(b) if is_bitwise(*b) => {
            for slot in 0..2 {
                let v = required(ins, slot)?;
                if !matches!(v.dtype, DType::I32 | DType::Bool) {
                    return Err(format!("bitwise op on {} input {slot}", v.dtype.name()));
                }
            }
            Ok(())
        }
        Op::Where => match required(ins, 0)?.dtype {
            DType::Bool => Ok(()),
            d => Err(format!(
                "where with a {} condition (bool expected)",
                d.name()
            )),
        },
        Op::Reduce {
            op: ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod,
            ..
        } => float(required(ins, 0)?, 0),
        Op::Reduce {
            op: ReduceOp::Max | ReduceOp::Min,
            ..
        }
        | Op::ArgReduce { .. }
        | Op::ReduceWithIndices { .. } => {
            let x = required(ins, 0)?;
            if x.dtype == DType::I32 {
                Ok(())
            } else {
                float(x, 0)
            }
        }
        Op::TopK { k, .. } => {
            if *k > limits.max_topk {
                return Err(format!("top-k with k = {k} (at most {})", limits.max_topk));
            }
            float(required(ins, 0)?, 0)
        }
        Op::Var { .. }
        | Op::Softmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::BatchNorm { .. }
        | Op::GroupNorm { .. }
        | Op::MaxPool { .. }
        | Op::AvgPool { .. }
        | Op::AdaptiveAvgPool { .. } => {
            required(ins, 0)?;
            same_float(ins, all)
        }
        Op::MatMul | Op::Addmm { .. } | Op::Linear | Op::Convolution { .. } => {
            required(ins, 0)?;
            required(ins, 1)?;
            same_float(ins, all)
        }
        Op::Sdpa { .. } => {
            same_float(ins, 0..3)?;
            for slot in [0, 2] {
                let head = required(ins, slot)?.shape.last().copied().unwrap_or(1);
                if head > limits.max_head_dim {
                    return Err(format!(
                        "attention head dim {head} (at most {})",
                        limits.max_head_dim
                    ));
                }
            }
            match ins.get(3).copied().flatten() {
                Some(m) if m.dtype != DType::Bool => float(m, 3),
                _ => Ok(()),
            }
        }
        Op::Embedding => integer_index(required(ins, 1)?, 1),
        Op::IndexSelect { .. } | Op::Gather { .. } => integer_index(required(ins, 1)?, 1),
        Op::Index => {
            for (slot, v) in ins.iter().enumerate().skip(1) {
                if let Some(v) = v {
                    integer_index(v, slot)?;
                }
            }
            Ok(())
        }
        Op::Arange {
            start, end, dtype, ..
        } if *dtype == DType::I64 => {
            // computed in 32-bit lanes and sign-extended
            let fits = |s: &Scalar| i32::try_from(s.to_i64()).is_ok();
            if fits(start) && fits(end) {
                Ok(())
            } else {
                Err("int64 arange beyond the int32 range".into())
            }
        }
        _ => Ok(()),
    }
}

/// Bitwise ops take integer lanes only.
fn is_bitwise(b: BinaryOp) -> bool {
    matches!(
        b,
        BinaryOp::BitwiseAnd | BinaryOp::BitwiseOr | BinaryOp::BitwiseXor
    )
}
