//! The quantized (int4, int8) GEMM (prefill, M ≥ 16) on the tensor-core
//! kernels: its operands as [`GemmArgs`], the weight dequantized as the
//! kernel stages it.
//!
//! A is the activations `x [m, k]` (k-fast); B is `Wᵀ` for the quantized
//! weight `W [n, k]` in the layout of `etmetal_core::quant` (`[n, k·b/32]`
//! int32 words, code `i` of a word at bits `b·i`, a scale and a zero per
//! group of k and row: `w = q·scale + zero`), also k-fast. The chunk
//! reader `cb` that the kernel's staging calls takes four codes from one
//! word (a chunk starts at a multiple of 4 and groups are multiples of
//! 32, so the four share a word, a scale and a zero) and dequantizes them
//! on their way into workgroup memory: the dequantized weight is never
//! materialised.
//!
//! Precision: the 8×8 f32 form stages the dequantized values as they are
//! (what the portable kernel multiplies). The 16×16 form scales each row of
//! W into f16's range (a pre-pass, as for any operand) and rounds the f32
//! `q·scale + zero` to f16's 11 significant bits, so the module bound of
//! `coop` (exact 16-bit operands) does not hold for B: each weight is off
//! by at most 2^-11 of itself, below a bf16 weight's own rounding.

use std::fmt::Write;

use etmetal_core::quant::QuantFormat;
use etmetal_core::Result;

use super::coop;
use super::spec::{Epilogue, F16Scaling, Gemm, GemmArgs};
use super::split::SplitK;
use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::emit::KernelBuilder;
use crate::preprocess::expr::LazyRef;
use crate::preprocess::lowering::Lowering;

/// A quantized linear `y [m, n] = x [m, k] @ Wᵀ` as a GEMM's operands.
pub(crate) struct QuantOperands<'a> {
    /// `[m, k]`.
    pub x: &'a LazyRef,
    /// `[n, k/8]` (int4) or `[n, k/4]` (int8) int32 words.
    pub packed: &'a LazyRef,
    /// `[n, k/group_size]` each.
    pub scales: &'a LazyRef,
    pub zeros: &'a LazyRef,
    pub format: QuantFormat,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// `[m, n]`.
    pub out: BufferIdx,
}

impl QuantOperands<'_> {
    /// Add the tensor-core alternatives of dispatch `d` (the portable int4
    /// kernel computing the same output), where the product is worth them
    /// and the activations are 16-bit (the 16×16 form's conversion is exact
    /// for them only; f32 activations keep the portable kernel).
    pub(crate) fn alternatives(&self, lw: &mut Lowering, d: usize) -> Result<()> {
        let sixteen = matches!(
            self.x.dtype,
            etmetal_core::DType::F16 | etmetal_core::DType::BF16
        );
        let gemm = Gemm {
            batch: 1,
            m: self.m,
            n: self.n,
            k: self.k,
            a_k_fast: true,
            b_k_fast: true,
            coop: sixteen.then_some([F16Scaling::Lines, F16Scaling::Lines]),
            dynamic: None,
        };
        if !coop::worth(&gemm) {
            return Ok(());
        }
        // one workgroup per tile along all of k: no partial sums; the
        // packed weight is never copied (DESIGN: quantized weights)
        let split = SplitK::new(lw, 1, 1, self.m, self.n)?;
        coop::alternatives(lw, d, &gemm, &split, self, false)
    }

    /// WGSL of `fn dq4(c: u32, q: u32) -> vec4<f32>`: weights `q … q+3`
    /// (`q` a multiple of 4) of row `c` of W, dequantized.
    fn dequant(&self, kb: &mut KernelBuilder) -> Result<String> {
        kb.value_fn(self.packed, "wq")?;
        kb.value_fn(self.scales, "wsc")?;
        kb.value_fn(self.zeros, "wze")?;
        let (per, b) = (self.format.per_word(), self.format.bits);
        // the word holding codes q … q+3, shifted so that they are its low bits
        let word = match per {
            4 => "bitcast<u32>(wq(c, q / 4u))".to_string(),
            _ => format!(
                "bitcast<u32>(wq(c, q / {per}u)) >> ({}u * ((q / 4u) % {}u))",
                4 * b,
                per / 4
            ),
        };
        let mut s = String::new();
        let _ = writeln!(
            s,
            "fn dq4(c: u32, q: u32) -> vec4<f32> {{\n\
             \x20 let w = {word};\n\
             \x20 let codes = vec4<f32>((vec4<u32>(w) >> vec4<u32>(0u, {b}u, {}u, {}u)) & vec4<u32>({}u));\n\
             \x20 let g = q / {}u;\n\
             \x20 return codes * wsc(c, g) + vec4<f32>(wze(c, g));\n}}\n",
            2 * b,
            3 * b,
            self.format.max_code(),
            self.format.group_size
        );
        Ok(s)
    }
}

impl Epilogue for QuantOperands<'_> {
    fn store(&self, kb: &mut KernelBuilder) -> Result<String> {
        let write = kb.store(self.out, &format!("r * {}u + c", self.n), "v")?;
        Ok(format!(
            "fn gstore(bt: u32, r: u32, c: u32, v: f32) {{\n  {write}\n}}\n\n"
        ))
    }
}

impl GemmArgs for QuantOperands<'_> {
    fn elements(&self, kb: &mut KernelBuilder) -> Result<String> {
        kb.value_fn(self.x, "xa")?;
        let dq = self.dequant(kb)?;
        Ok(format!(
            "{dq}fn ga(bt: u32, r: u32, k: u32) -> f32 {{ return xa(r, k); }}\n\
             fn gb(bt: u32, k: u32, c: u32) -> f32 {{ return dq4(c, k & ~3u)[k % 4u]; }}\n"
        ))
    }

    fn chunks(&self, kb: &mut KernelBuilder) -> Result<Option<String>> {
        kb.value_fn(self.x, "xa")?;
        let dq = self.dequant(kb)?;
        // k is a multiple of 32 (of the group): a chunk the kernel keeps
        // never runs past it; one it masks out is clamped in bounds
        let last = self.k - 1;
        let lanes: Vec<String> = (0..4)
            .map(|i| format!("xa(j, min(q + {i}u, {last}u))"))
            .collect();
        Ok(Some(format!(
            "{dq}fn ca(bt: u32, j: u32, q: u32) -> vec4<f32> {{\n  return vec4<f32>({});\n}}\n\n\
             fn cb(bt: u32, j: u32, q: u32) -> vec4<f32> {{ return dq4(j, q); }}\n\n",
            lanes.join(", ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use crate::preprocess::kernels::testing::lower_int4_linear;
    use etmetal_core::DType;

    /// A prefill-sized int4 linear keeps its portable kernel and gains both
    /// tensor-core forms, dequantizing as they stage (validated by naga,
    /// with MSL); decode-sized, f32-activation and small ones gain none.
    #[test]
    fn int4_gemm_gains_tensor_core_alternatives() {
        let (n, k, g) = (96, 256, 32);
        let linear = |dtype, m| lower_int4_linear(dtype, m, n, k, g).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let p = linear(dtype, 64).payload;
            let with: Vec<_> = p
                .dispatches
                .iter()
                .filter(|d| !d.alternatives.is_empty())
                .collect();
            assert_eq!(with.len(), 1, "{dtype:?}");
            let portable = &p.kernels[with[0].kernel].name;
            assert!(portable.ends_with("int4_linear"), "{portable}");
            let tags: Vec<Vec<String>> = with[0]
                .alternatives
                .iter()
                .map(|a| {
                    a.dispatches
                        .iter()
                        .map(|d| p.kernels[d.kernel].name.rsplit('_').next().unwrap().into())
                        .collect()
                })
                .collect();
            assert_eq!(
                tags,
                [vec!["range", "range", "coop"], vec!["coop8x8"]],
                "{dtype:?}"
            );
            // the staging reads the packed words, never a dequantized copy
            let coop = with[0].alternatives[0].dispatches.last().unwrap();
            assert!(p.kernels[coop.kernel].wgsl.contains("fn dq4("));
        }
        for (dtype, m) in [(DType::BF16, 8), (DType::F32, 64), (DType::BF16, 17)] {
            let p = linear(dtype, m).payload;
            assert!(
                p.dispatches.iter().all(|d| d.alternatives.is_empty()),
                "{dtype:?} m = {m}"
            );
        }
    }
}
