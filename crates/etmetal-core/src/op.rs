//! The typed operator set: what a graph node computes, independent of where
//! it came from (a torch.export target, an ExecuTorch kernel call) and of
//! where it runs (CPU kernels, GPU kernels).
//!
//! A node's inputs are a list of optional tensor slots in the order given on
//! each variant (`None` marks an absent optional tensor); everything else an
//! op needs is an attribute here. Dims are already normalised (non-negative,
//! in range); scalars of binary ops are 0-d constant tensors of the dtype that
//! PyTorch's promotion gives them, so every binary op sees two tensors.

use crate::dtype::DType;

/// A scalar attribute, kept exact for integers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl Scalar {
    pub fn to_f64(self) -> f64 {
        match self {
            Scalar::Int(v) => v as f64,
            Scalar::Float(v) => v,
            Scalar::Bool(v) => v as i64 as f64,
        }
    }
    pub fn to_i64(self) -> i64 {
        match self {
            Scalar::Int(v) => v,
            Scalar::Float(v) => v as i64,
            Scalar::Bool(v) => v as i64,
        }
    }
}

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

impl BinaryOp {
    /// Whether the result is bool regardless of the inputs.
    pub fn is_predicate(self) -> bool {
        use BinaryOp::*;
        matches!(
            self,
            Eq | Ne | Lt | Le | Gt | Ge | LogicalAnd | LogicalOr | LogicalXor
        )
    }
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
    /// `[x, weight, bias?]` → `[y]`: N-d convolution (1-D and 2-D at least),
    /// attribute vectors have one entry per spatial dim.
    Convolution {
        stride: Vec<usize>,
        padding: Vec<usize>,
        dilation: Vec<usize>,
        transposed: bool,
        output_padding: Vec<usize>,
        groups: usize,
    },
    /// `[x]` → `[y]` or `[y, indices]` (`with_indices`).
    MaxPool {
        kernel: Vec<usize>,
        stride: Vec<usize>,
        padding: Vec<usize>,
        dilation: Vec<usize>,
        ceil_mode: bool,
        with_indices: bool,
    },
    /// `[x]` → `[y]`
    AvgPool {
        kernel: Vec<usize>,
        stride: Vec<usize>,
        padding: Vec<usize>,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: Option<i64>,
    },
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
    /// weight `W [N, K]` in the layout of [`crate::int4`] (torchao's
    /// `_linear_fp_act_4bit_weight`); `y` has x's dtype.
    Int4Linear { group_size: usize },
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
    /// Short name for messages and histograms (`"convolution"`, `"add"`).
    pub fn name(&self) -> String {
        fn snake(debug: String) -> String {
            let head: String = debug.chars().take_while(|c| c.is_alphanumeric()).collect();
            let mut out = String::new();
            for (i, c) in head.chars().enumerate() {
                if c.is_uppercase() {
                    if i > 0 {
                        out.push('_');
                    }
                    out.extend(c.to_lowercase());
                } else {
                    out.push(c);
                }
            }
            out
        }
        match self {
            Op::Unary(u) => snake(format!("{u:?}")),
            Op::Binary(b) => snake(format!("{b:?}")),
            Op::Reduce { op, .. } => format!("reduce_{}", snake(format!("{op:?}"))),
            other => snake(format!("{other:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_snake_case() {
        assert_eq!(Op::Unary(UnaryOp::Gelu { tanh: true }).name(), "gelu");
        assert_eq!(Op::Binary(BinaryOp::FloorDiv).name(), "floor_div");
        assert_eq!(Op::MatMul.name(), "mat_mul");
        assert_eq!(
            Op::Reduce {
                op: ReduceOp::Sum,
                dims: vec![],
                keepdim: false
            }
            .name(),
            "reduce_sum"
        );
        assert_eq!(
            Op::Sdpa {
                is_causal: true,
                scale: None,
                enable_gqa: false
            }
            .name(),
            "sdpa"
        );
    }
}
