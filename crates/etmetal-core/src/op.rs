//! The typed operator set: what a graph node computes, independent of where
//! it came from (a torch.export target, an ExecuTorch kernel call) and of
//! where it runs (CPU kernels, GPU kernels).
//!
//! A node's inputs are a list of optional tensor slots in the order given on
//! each variant (`None` marks an absent optional tensor); everything else an
//! op needs is an attribute here. Dims are already normalised (non-negative,
//! in range); scalars of binary ops are 0-d constant tensors of the dtype that
//! PyTorch's promotion gives them, so every binary op sees two tensors.

use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::shape;

/// Elementwise functions of one tensor. The output dtype is the input's
/// (floats), or the node's output dtype where PyTorch promotes (e.g. `sqrt`
/// of an integer tensor gives float32).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    Relu,
    /// `gelu(x, approximate='none'|'tanh')`
    Gelu {
        tanh: bool,
    },
    Silu,
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Neg,
    Abs,
    Reciprocal,
    Sin,
    Cos,
    Erf,
    Floor,
    Ceil,
    Round,
    Sign,
    Hardswish,
    Hardsigmoid,
    LeakyRelu {
        slope: f64,
    },
    /// `clamp(x, min, max)`; `relu6`/`hardtanh` are clamps.
    Clamp {
        min: Option<f64>,
        max: Option<f64>,
    },
    /// `pow(x, exponent)` with a scalar exponent.
    PowScalar {
        exponent: f64,
    },
    LogicalNot,
    /// `bitwise_not`; on bool it is logical not.
    BitwiseNot,
}

/// Elementwise functions of two broadcast tensors. Computed in the promoted
/// dtype of the two inputs; comparisons and logical ops give bool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    /// True division (`div.Tensor` with no rounding mode).
    Div,
    /// `div(rounding_mode='floor')` / `floor_divide`
    FloorDiv,
    /// `div(rounding_mode='trunc')`
    TruncDiv,
    /// Python-style remainder (sign of the divisor).
    Remainder,
    Pow,
    Maximum,
    Minimum,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    LogicalAnd,
    LogicalOr,
    LogicalXor,
    BitwiseAnd,
    BitwiseOr,
    BitwiseXor,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
    /// `amax` / `max.dim` values
    Max,
    /// `amin` / `min.dim` values
    Min,
    Prod,
    /// `any` (bool result)
    Any,
    /// `all` (bool result)
    All,
}

/// The attributes of [`Op::Convolution`]: `stride`, `padding` and
/// `dilation` have one entry per spatial dim, `output_padding` one per
/// spatial dim or none (zeros).
#[derive(Clone, Debug, PartialEq)]
pub struct ConvAttrs {
    pub stride: Vec<usize>,
    pub padding: Vec<usize>,
    pub dilation: Vec<usize>,
    pub transposed: bool,
    pub output_padding: Vec<usize>,
    pub groups: usize,
}

impl ConvAttrs {
    /// Number of spatial dims (1 for `conv1d`, 2 for `conv2d`, …).
    pub fn spatial_rank(&self) -> usize {
        self.stride.len()
    }

    /// `(input channels, output channels)` of a weight of shape `weight`
    /// (`[cout, cin/groups, k…]`, or `[cin, cout/groups, k…]` transposed).
    pub fn channels(&self, weight: &[usize]) -> (usize, usize) {
        let g = self.groups.max(1);
        let (a, b) = (
            weight.first().copied().unwrap_or(0),
            weight.get(1).copied().unwrap_or(0),
        );
        if self.transposed {
            (a, b * g)
        } else {
            (b * g, a)
        }
    }

    /// The output's spatial sizes for an input with spatial sizes `input`
    /// and a kernel of spatial sizes `kernel` (PyTorch's formulas, see
    /// [`shape::conv_output_size`] and [`shape::conv_transpose_output_size`]).
    pub fn output_spatial(&self, input: &[usize], kernel: &[usize]) -> Result<Vec<usize>> {
        let sr = self.spatial_rank();
        if sr == 0
            || [&self.padding, &self.dilation]
                .iter()
                .any(|v| v.len() != sr)
            || !(self.output_padding.is_empty() || self.output_padding.len() == sr)
        {
            return Err(Error::shape(format!(
                "stride {:?}, padding {:?}, dilation {:?} and output_padding {:?} need one entry per spatial dim",
                self.stride, self.padding, self.dilation, self.output_padding
            )));
        }
        if input.len() != sr || kernel.len() != sr {
            return Err(Error::shape(format!(
                "a {sr}-d convolution of spatial sizes {input:?} by a kernel {kernel:?}"
            )));
        }
        (0..sr)
            .map(|d| {
                let (i, k, s) = (input[d], kernel[d], self.stride[d]);
                let (p, dil) = (self.padding[d], self.dilation[d]);
                if self.transposed {
                    let op = self.output_padding.get(d).copied().unwrap_or(0);
                    shape::conv_transpose_output_size(i, k, s, p, dil, op)
                } else {
                    shape::conv_output_size(i, k, s, p, dil)
                }
                .map_err(|e| e.context(format!("spatial dim {d}")))
            })
            .collect()
    }
}

/// The attributes of [`Op::MaxPool`], as PyTorch's `max_pool*d` takes them:
/// one entry per spatial dim in `kernel`; `stride`, `padding` and `dilation`
/// may also hold a single entry for every dim, or none for the default
/// (see [`MaxPoolAttrs::window`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MaxPoolAttrs {
    pub kernel: Vec<usize>,
    pub stride: Vec<usize>,
    pub padding: Vec<usize>,
    pub dilation: Vec<usize>,
    pub ceil_mode: bool,
    pub with_indices: bool,
}

impl MaxPoolAttrs {
    /// Number of spatial dims.
    pub fn spatial_rank(&self) -> usize {
        self.kernel.len()
    }

    /// The window with one entry per spatial dim.
    pub fn window(&self) -> Result<PoolWindow> {
        PoolWindow::new(
            &self.kernel,
            &self.stride,
            &self.padding,
            &self.dilation,
            self.ceil_mode,
        )
    }
}

/// The attributes of [`Op::AvgPool`], with `stride` and `padding` as in
/// [`MaxPoolAttrs`]; `divisor_override` replaces the window size.
#[derive(Clone, Debug, PartialEq)]
pub struct AvgPoolAttrs {
    pub kernel: Vec<usize>,
    pub stride: Vec<usize>,
    pub padding: Vec<usize>,
    pub ceil_mode: bool,
    pub count_include_pad: bool,
    pub divisor_override: Option<i64>,
}

impl AvgPoolAttrs {
    /// Number of spatial dims.
    pub fn spatial_rank(&self) -> usize {
        self.kernel.len()
    }

    /// The window with one entry per spatial dim (dilation 1).
    pub fn window(&self) -> Result<PoolWindow> {
        PoolWindow::new(
            &self.kernel,
            &self.stride,
            &self.padding,
            &[],
            self.ceil_mode,
        )
    }
}

/// A pooling window with one entry per spatial dim in every field.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolWindow {
    pub kernel: Vec<usize>,
    pub stride: Vec<usize>,
    pub padding: Vec<usize>,
    pub dilation: Vec<usize>,
    pub ceil_mode: bool,
}

impl PoolWindow {
    /// PyTorch's int-or-tuple attributes: a single entry repeats for every
    /// spatial dim; an empty stride is the kernel, an empty padding 0 and an
    /// empty dilation 1.
    pub fn new(
        kernel: &[usize],
        stride: &[usize],
        padding: &[usize],
        dilation: &[usize],
        ceil_mode: bool,
    ) -> Result<PoolWindow> {
        let sr = kernel.len();
        let per_dim = |v: &[usize], default: &[usize], what: &str| match v.len() {
            0 => Ok(default.to_vec()),
            1 => Ok(vec![v[0]; sr]),
            n if n == sr => Ok(v.to_vec()),
            n => Err(Error::shape(format!(
                "pooling {what} has {n} entries for {sr} spatial dims"
            ))),
        };
        Ok(PoolWindow {
            kernel: kernel.to_vec(),
            stride: per_dim(stride, kernel, "stride")?,
            padding: per_dim(padding, &vec![0; sr], "padding")?,
            dilation: per_dim(dilation, &vec![1; sr], "dilation")?,
            ceil_mode,
        })
    }

    /// Number of spatial dims.
    pub fn spatial_rank(&self) -> usize {
        self.kernel.len()
    }

    /// The output's spatial sizes for an input with spatial sizes `input`
    /// ([`shape::pool_output_size`] per dim).
    pub fn output_spatial(&self, input: &[usize]) -> Result<Vec<usize>> {
        if input.len() != self.spatial_rank() {
            return Err(Error::shape(format!(
                "a {}-d pool of spatial sizes {input:?}",
                self.spatial_rank()
            )));
        }
        (0..input.len())
            .map(|d| {
                shape::pool_output_size(
                    input[d],
                    self.kernel[d],
                    self.stride[d],
                    self.padding[d],
                    self.dilation[d],
                    self.ceil_mode,
                )
                .map_err(|e| e.context(format!("spatial dim {d}")))
            })
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `[x]` → `[y]`
    Unary(UnaryOp),
    /// `[a, b]` → `[y]`, broadcasting.
    Binary(BinaryOp),
    /// `[cond, a, b]` → `[y]`, broadcasting; `masked_fill(x, m, v)` is
    /// `where(m, v, x)`.
    Where,
    /// `[x]` → `[y]`: dtype conversion (`_to_copy`, `to.dtype`, `type_as`).
    Cast { dtype: DType },
    /// `[x]` → `[y]`: `clone`, `contiguous`, `alias`, `detach`, eval-mode
    /// `dropout`, `lift_fresh_copy`: a copy with the same values.
    Identity,

    /// `[x]` → `[y]`: reduce `dims` (all dims when empty); the output dtype
    /// is the node's (sum of ints gives int64, `dtype=` overrides).
    Reduce {
        op: ReduceOp,
        dims: Vec<usize>,
        keepdim: bool,
    },
    /// `[x]` → `[y]`: variance with Bessel-style `correction` (0 or 1 usually).
    Var {
        dims: Vec<usize>,
        correction: f64,
        keepdim: bool,
    },
    /// `[x]` → `[indices]` (int64); `dim: None` reduces the flattened tensor.
    ArgReduce {
        max: bool,
        dim: Option<usize>,
        keepdim: bool,
    },
    /// `[x]` → `[values, indices]`: `max.dim` / `min.dim`.
    ReduceWithIndices {
        max: bool,
        dim: usize,
        keepdim: bool,
    },
    /// `[x]` → `[y]`: `cumsum(dim)`; output dtype is the node's.
    CumSum { dim: usize },
    /// `[x]` → `[y]`: `softmax` / `log_softmax` over `dim`.
    Softmax { dim: usize, log: bool },
    /// `[x]` → `[values, indices]`.
    TopK {
        k: usize,
        dim: usize,
        largest: bool,
        sorted: bool,
    },

    /// `[x, weight?, bias?]` → `[y]`: over the last `normalized_dims` dims.
    LayerNorm { normalized_dims: usize, eps: f64 },
    /// `[x, weight?]` → `[y]`; `eps: None` means `finfo(dtype).eps`.
    RmsNorm {
        normalized_dims: usize,
        eps: Option<f64>,
    },
    /// `[x, weight?, bias?, running_mean, running_var]` → `[y]`: eval-mode
    /// batch norm over dim 1.
    BatchNorm { eps: f64 },
    /// `[x, weight?, bias?]` → `[y]`: over `groups` groups of dim 1.
    GroupNorm { groups: usize, eps: f64 },

    /// `[a, b]` → `[y]`: `torch.matmul` semantics (1-D operands, batch
    /// broadcasting); covers `mm` and `bmm`.
    MatMul,
    /// `[bias, a, b]` → `[y]`: `beta * bias + alpha * (a @ b)`, 2-D.
    Addmm { beta: f64, alpha: f64 },
    /// `[x, weight, bias?]` → `[y]`: `x @ weight.T + bias`.
    Linear,
    /// `[x, weight, bias?]` → `[y]`: N-d convolution (1-D and 2-D at least).
    Convolution(ConvAttrs),
    /// `[x]` → `[y]` or `[y, indices]` (`with_indices`).
    MaxPool(MaxPoolAttrs),
    /// `[x]` → `[y]`
    AvgPool(AvgPoolAttrs),
    /// `[x]` → `[y]`: adaptive average pooling to `output_size` (spatial dims).
    AdaptiveAvgPool { output_size: Vec<usize> },
    /// `[q, k, v, mask?]` → `[y]`: scaled dot-product attention; a bool mask
    /// keeps `true` positions, a float mask is added to the scores.
    /// `enable_gqa` repeats k/v heads to match q's.
    Sdpa {
        is_causal: bool,
        scale: Option<f64>,
        enable_gqa: bool,
    },

    /// `[weight, indices]` → `[y]`
    Embedding,
    /// `[x]` → `[y]`: same elements, new shape (view, reshape, flatten,
    /// squeeze, unsqueeze).
    Reshape { shape: Vec<usize> },
    /// `[x]` → `[y]`: `y.shape[i] = x.shape[dims[i]]`.
    Permute { dims: Vec<usize> },
    /// `[x]` → `[y]`: broadcast to `shape` (same rank or more).
    Expand { shape: Vec<usize> },
    /// `[x]` → `[y]`: `start..end` by `step` along `dim`, already clamped to
    /// the dim (`end >= start`).
    Slice {
        dim: usize,
        start: usize,
        end: usize,
        step: usize,
    },
    /// `[x]` → `[y]`: index `index` of `dim`, which is removed.
    Select { dim: usize, index: usize },
    /// `[x0, x1, …]` → `[y]`
    Cat { dim: usize },
    /// `[x]` → `[y]`: `constant_pad_nd`; `pad` as in PyTorch (last dim
    /// first, pairs of before/after, may be negative).
    ConstantPad { pad: Vec<i64>, value: f64 },
    /// `[x, index]` → `[y]`
    IndexSelect { dim: usize },
    /// `[x, index]` → `[y]`
    Gather { dim: usize },
    /// `[x, index, source]` → `[y]`: `index_copy` (and `index_put` with
    /// one index tensor): `x` with row `index[m]` of `dim` replaced by row
    /// `m` of `source` (`x`'s shape with `dim` the index's length); a 1-D
    /// or 0-d integer index of distinct rows.
    IndexCopy { dim: usize },
    /// `[x, i0?, i1?, …]` → `[y]`: advanced indexing `x[i0, i1, …]` with
    /// int64 (or bool) index tensors; `None` slots keep the whole dim.
    Index,
    /// `[x]` → `[y]`: upper (`upper`) or lower triangle, offset by `diagonal`.
    Triangle { upper: bool, diagonal: i64 },
    /// `[x]` → `[y]`: `repeat(repeats)`.
    Repeat { repeats: Vec<usize> },

    /// `[]` → `[y]`: `full`, `zeros`, `ones`, `*_like`, `scalar_tensor`.
    Full {
        shape: Vec<usize>,
        value: Scalar,
        dtype: DType,
    },
    /// `[inputs…]` → `[outputs…]`: a call of delegate `index` of the
    /// program (ExecuTorch's `executorch_call_delegate`): what a backend
    /// took out of the graph. Only compile and runtime plumbing see it.
    Delegate { index: usize },
    /// `[]` → `[y]`: `arange(start, end, step)`.
    Arange {
        start: Scalar,
        end: Scalar,
        step: Scalar,
        dtype: DType,
    },

    /// `[x, packed, scales, zeros]` → `[y]`: `x [.., K] @ W.T` with the int4
    /// weight `W [N, K]` in the layout of [`crate::quant`] (torchao's
    /// `_linear_fp_act_4bit_weight`); `y` has x's dtype.
    Int4Linear { group_size: usize },
    /// [`Op::Int4Linear`] with 8-bit codes (the same layout, a code a
    /// byte); a group of all of K is one scale and zero per output channel.
    Int8Linear { group_size: usize },
    /// `[x, packed, scales, zeros, expert_indices]` → `[y]`: MoE
    /// (`metal::gather_qmv`): `y[p] = W[expert_indices[p]] @ x[p]` for
    /// `x [P, K]`, int4 expert weights `[E, N, K/2]`, scales and zeros
    /// `[E, N, K/group]`, integer indices `[P]`; `y [P, N]` in x's dtype.
    GatherQmv { group_size: usize },
    /// `[q, k, v, g, beta, state]` → `[y, new_state]`: Qwen3.5's gated delta
    /// rule (`metal::gated_delta_rule`), a recurrence over T computed in
    /// f32. `q, k [B, T, Hk, Dk]`, `v [B, T, Hv, Dv]`, `g, beta [B, T, Hv]`,
    /// `state [B, Hv, Dv, Dk]`; key heads repeat to `Hv`. Per step:
    /// `s *= g; s += k ⊗ ((v - s·k) * beta); y = s·q`. `y [B, T, Hv, Dv]`
    /// in q's dtype, `new_state` in state's.
    GatedDeltaRule,
}

impl Op {
    /// Short name for messages and histograms (`"convolution"`, `"add"`),
    /// and the name `--skip-op` takes: keep these strings stable.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Where => "where",
            Op::Cast { .. } => "cast",
            Op::Identity => "identity",
            Op::Reduce { op, .. } => op.name(),
            Op::Var { .. } => "var",
            Op::ArgReduce { .. } => "arg_reduce",
            Op::ReduceWithIndices { .. } => "reduce_with_indices",
            Op::CumSum { .. } => "cum_sum",
            Op::Softmax { .. } => "softmax",
            Op::TopK { .. } => "top_k",
            Op::LayerNorm { .. } => "layer_norm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::BatchNorm { .. } => "batch_norm",
            Op::GroupNorm { .. } => "group_norm",
            Op::MatMul => "mat_mul",
            Op::Addmm { .. } => "addmm",
            Op::Linear => "linear",
            Op::Convolution(_) => "convolution",
            Op::MaxPool(_) => "max_pool",
            Op::AvgPool(_) => "avg_pool",
            Op::AdaptiveAvgPool { .. } => "adaptive_avg_pool",
            Op::Sdpa { .. } => "sdpa",
            Op::Embedding => "embedding",
            Op::Reshape { .. } => "reshape",
            Op::Permute { .. } => "permute",
            Op::Expand { .. } => "expand",
            Op::Slice { .. } => "slice",
            Op::Select { .. } => "select",
            Op::Cat { .. } => "cat",
            Op::ConstantPad { .. } => "constant_pad",
            Op::IndexSelect { .. } => "index_select",
            Op::Gather { .. } => "gather",
            Op::IndexCopy { .. } => "index_copy",
            Op::Index => "index",
            Op::Triangle { .. } => "triangle",
            Op::Repeat { .. } => "repeat",
            Op::Full { .. } => "full",
            Op::Delegate { .. } => "delegate",
            Op::Arange { .. } => "arange",
            Op::Int4Linear { .. } => "int4_linear",
            Op::Int8Linear { .. } => "int8_linear",
            Op::GatherQmv { .. } => "gather_qmv",
            Op::GatedDeltaRule => "gated_delta_rule",
        }
    }
}

impl ReduceOp {
    /// The name of a [`Op::Reduce`] with this op ([`Op::name`]).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "reduce_sum",
            ReduceOp::Mean => "reduce_mean",
            ReduceOp::Max => "reduce_max",
            ReduceOp::Min => "reduce_min",
            ReduceOp::Prod => "reduce_prod",
            ReduceOp::Any => "reduce_any",
            ReduceOp::All => "reduce_all",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// One op of every variant and sub-op.
    fn every_op() -> Vec<Op> {
        use BinaryOp as B;
        use UnaryOp as U;
        let unary = [
            U::Relu,
            U::Gelu { tanh: true },
            U::Silu,
            U::Sigmoid,
            U::Tanh,
            U::Exp,
            U::Log,
            U::Sqrt,
            U::Rsqrt,
            U::Neg,
            U::Abs,
            U::Reciprocal,
            U::Sin,
            U::Cos,
            U::Erf,
            U::Floor,
            U::Ceil,
            U::Round,
            U::Sign,
            U::Hardswish,
            U::Hardsigmoid,
            U::LeakyRelu { slope: 0.1 },
            U::Clamp {
                min: None,
                max: Some(6.0),
            },
            U::PowScalar { exponent: 2.0 },
            U::LogicalNot,
            U::BitwiseNot,
        ];
        let binary = [
            B::Add,
            B::Sub,
            B::Mul,
            B::Div,
            B::FloorDiv,
            B::TruncDiv,
            B::Remainder,
            B::Pow,
            B::Maximum,
            B::Minimum,
            B::Eq,
            B::Ne,
            B::Lt,
            B::Le,
            B::Gt,
            B::Ge,
            B::LogicalAnd,
            B::LogicalOr,
            B::LogicalXor,
            B::BitwiseAnd,
            B::BitwiseOr,
            B::BitwiseXor,
        ];
        let reduce = [
            ReduceOp::Sum,
            ReduceOp::Mean,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Prod,
            ReduceOp::Any,
            ReduceOp::All,
        ];
        let v = Vec::new;
        let mut ops: Vec<Op> = unary.into_iter().map(Op::Unary).collect();
        ops.extend(binary.into_iter().map(Op::Binary));
        ops.extend(reduce.into_iter().map(|op| Op::Reduce {
            op,
            dims: v(),
            keepdim: false,
        }));
        ops.extend([
            Op::Where,
            Op::Cast { dtype: DType::F32 },
            Op::Identity,
            Op::Var {
                dims: v(),
                correction: 1.0,
                keepdim: false,
            },
            Op::ArgReduce {
                max: true,
                dim: None,
                keepdim: false,
            },
            Op::ReduceWithIndices {
                max: true,
                dim: 0,
                keepdim: false,
            },
            Op::CumSum { dim: 0 },
            Op::Softmax { dim: 0, log: false },
            Op::TopK {
                k: 1,
                dim: 0,
                largest: true,
                sorted: true,
            },
            Op::LayerNorm {
                normalized_dims: 1,
                eps: 1e-5,
            },
            Op::RmsNorm {
                normalized_dims: 1,
                eps: None,
            },
            Op::BatchNorm { eps: 1e-5 },
            Op::GroupNorm {
                groups: 1,
                eps: 1e-5,
            },
            Op::MatMul,
            Op::Addmm {
                beta: 1.0,
                alpha: 1.0,
            },
            Op::Linear,
            Op::Convolution(ConvAttrs {
                stride: vec![1],
                padding: vec![0],
                dilation: vec![1],
                transposed: false,
                output_padding: vec![0],
                groups: 1,
            }),
            Op::MaxPool(MaxPoolAttrs {
                kernel: vec![2],
                stride: v(),
                padding: v(),
                dilation: v(),
                ceil_mode: false,
                with_indices: false,
            }),
            Op::AvgPool(AvgPoolAttrs {
                kernel: vec![2],
                stride: v(),
                padding: v(),
                ceil_mode: false,
                count_include_pad: true,
                divisor_override: None,
            }),
            Op::AdaptiveAvgPool {
                output_size: vec![1],
            },
            Op::Sdpa {
                is_causal: true,
                scale: None,
                enable_gqa: false,
            },
            Op::Embedding,
            Op::Reshape { shape: v() },
            Op::Permute { dims: v() },
            Op::Expand { shape: v() },
            Op::Slice {
                dim: 0,
                start: 0,
                end: 1,
                step: 1,
            },
            Op::Select { dim: 0, index: 0 },
            Op::Cat { dim: 0 },
            Op::ConstantPad {
                pad: vec![],
                value: 0.0,
            },
            Op::IndexSelect { dim: 0 },
            Op::Gather { dim: 0 },
            Op::IndexCopy { dim: 0 },
            Op::Index,
            Op::Triangle {
                upper: true,
                diagonal: 0,
            },
            Op::Repeat { repeats: v() },
            Op::Full {
                shape: v(),
                value: Scalar::Int(0),
                dtype: DType::I64,
            },
            Op::Delegate { index: 0 },
            Op::Arange {
                start: Scalar::Int(0),
                end: Scalar::Int(1),
                step: Scalar::Int(1),
                dtype: DType::I64,
            },
            Op::Int4Linear { group_size: 32 },
            Op::Int8Linear { group_size: 32 },
            Op::GatherQmv { group_size: 32 },
            Op::GatedDeltaRule,
        ]);
        ops
    }

    /// The snake-case name of a `Debug` rendering's leading identifier:
    /// how names were made before the table, so the table keeps them.
    fn snake(debug: String) -> String {
        let mut out = String::new();
        for (i, c) in debug
            .chars()
            .take_while(|c| c.is_alphanumeric())
            .enumerate()
        {
            if c.is_uppercase() && i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        }
        out
    }

    #[test]
    fn names_are_unique_and_keep_their_spelling() {
        let ops = every_op();
        let names: BTreeSet<&str> = ops.iter().map(Op::name).collect();
        assert_eq!(names.len(), ops.len(), "two ops share a name");
        for op in &ops {
            let was = match op {
                Op::Unary(u) => snake(format!("{u:?}")),
                Op::Binary(b) => snake(format!("{b:?}")),
                Op::Reduce { op, .. } => format!("reduce_{}", snake(format!("{op:?}"))),
                other => snake(format!("{other:?}")),
            };
            assert_eq!(op.name(), was, "{op:?}");
        }
        for name in [
            "gelu",
            "floor_div",
            "mat_mul",
            "reduce_sum",
            "sdpa",
            "max_pool",
        ] {
            assert!(names.contains(name), "{name}");
        }
    }

    #[test]
    fn python_scalars_take_pytorchs_default_dtypes() {
        assert_eq!(Scalar::Int(3).dtype(), DType::I64);
        assert_eq!(Scalar::Float(0.5).dtype(), DType::F32);
        assert_eq!(Scalar::Bool(true).dtype(), DType::Bool);
    }

    #[test]
    fn pool_windows_expand_pytorchs_int_or_tuple_attributes() {
        // `max_pool2d(x, 3, padding=1)`: one padding for both dims, stride
        // defaults to the kernel, dilation to 1
        let p = MaxPoolAttrs {
            kernel: vec![3, 2],
            stride: vec![],
            padding: vec![1],
            dilation: vec![],
            ceil_mode: true,
            with_indices: false,
        };
        let w = p.window().unwrap();
        assert_eq!(
            (
                w.stride.as_slice(),
                w.padding.as_slice(),
                w.dilation.as_slice()
            ),
            (&[3, 2][..], &[1, 1][..], &[1, 1][..])
        );
        // PyTorch 2.15: F.max_pool2d(zeros(1, 1, 7, 5), (3, 2), padding=1,
        // ceil_mode=True) has shape [1, 1, 3, 3]
        assert_eq!(w.output_spatial(&[7, 5]).unwrap(), [3, 3]);
        assert!(w.output_spatial(&[7]).is_err());
        let bad = MaxPoolAttrs {
            stride: vec![1, 1, 1],
            ..p
        };
        assert!(bad.window().is_err());
        let avg = AvgPoolAttrs {
            kernel: vec![2],
            stride: vec![],
            padding: vec![],
            ceil_mode: false,
            count_include_pad: true,
            divisor_override: None,
        };
        assert_eq!(avg.window().unwrap().output_spatial(&[5]).unwrap(), [2]);
    }

    #[test]
    fn conv_attributes_give_channels_and_output_sizes() {
        let mut c = ConvAttrs {
            stride: vec![2],
            padding: vec![1],
            dilation: vec![2],
            transposed: false,
            output_padding: vec![],
            groups: 2,
        };
        // weight [cout, cin/groups, k]
        assert_eq!(c.channels(&[6, 2, 3]), (4, 6));
        // PyTorch 2.15: F.conv1d(zeros(1, 4, 4), zeros(6, 2, 3), stride=2,
        // padding=1, dilation=2, groups=2) has length 1
        assert_eq!(c.output_spatial(&[4], &[3]).unwrap(), [1]);
        // transposed weight [cin, cout/groups, k]; F.conv_transpose1d(
        // zeros(1, 6, 4), zeros(6, 2, 3), stride=2, padding=1, dilation=2,
        // groups=2) has 4 channels of length 9
        c.transposed = true;
        assert_eq!(c.channels(&[6, 2, 3]), (6, 4));
        assert_eq!(c.output_spatial(&[4], &[3]).unwrap(), [9]);
        c.output_padding = vec![1];
        assert_eq!(c.output_spatial(&[4], &[3]).unwrap(), [10]);
        c.padding = vec![1, 1];
        assert!(c.output_spatial(&[4], &[3]).is_err());
    }
}
