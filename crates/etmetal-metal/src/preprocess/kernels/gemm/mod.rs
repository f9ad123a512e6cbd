//! The GEMM family: batched matrix products `C[bt, r, c] = Σ_k A[bt, r, k]
//! · B[bt, k, c]` as shape-specialised kernels, for `matmul`/`addmm`/
//! `linear` ([`super::matmul`]) and convolution as an implicit GEMM
//! ([`super::conv`]). A caller describes the product ([`Gemm`], or
//! [`Gemv`] for a few rows against a `k`-contiguous weight) and says how
//! the kernels read its operands and store its results ([`GemmArgs`],
//! [`GemvArgs`], [`Epilogue`]), so fused reads (views, patches of an
//! image) and fused stores (bias, alpha/beta, layout) plug in.
//!
//! - `spec`: the leaf: [`Gemm`], [`F16Scaling`], `FILL` and the args traits;
//! - `tiled`: the portable register-tiled kernel;
//! - `coop`: the cooperative-matrix (tensor-core) kernels for 16-bit
//!   operands (variants the runtime measures), with their scaling into
//!   f16's range and the f16 copies some of them read;
//! - `gemv`: the matrix-vector kernel (also several products of one
//!   input in one dispatch);
//! - `split`: split-K partial sums and their sum;
//! - `lower`: [`Gemm::lower`], the portable dispatch plus the tensor-core
//!   alternatives;
//! - `dequant`: the int4 GEMM's operands for the tensor-core kernels, the
//!   weight dequantized as it is staged.

mod coop;
mod dequant;
mod gemv;
mod lower;
mod spec;
mod split;
mod tiled;

pub(super) use coop::HELPERS as F16_SCALING_WGSL;
pub use coop::VARIANT_COUNT as GEMM_COOP_VARIANTS;
pub(super) use dequant::QuantOperands;
#[cfg(test)]
pub(super) use gemv::GROUP_FILL;
pub(super) use gemv::{
    column_groups, reduce_sums, unrolled_passes, Gemv, GEMV_ROWS, WORKGROUP_BYTES,
};
pub(super) use spec::{Epilogue, F16Scaling, Gemm, GemmArgs, GemvArgs};
