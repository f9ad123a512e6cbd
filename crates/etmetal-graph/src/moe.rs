//! Mixture-of-experts layers' routed experts. A decode step's grouped
//! matmul reads only its routed experts' weights (the importer's sparse
//! form, `pt2::lower::composite`, `grouped_mm_sparse`): on an H100 this
//! took a Qwen3-MoE-shaped decode step (6 layers, 8 experts routed top-2)
//! from 2.02 to 1.77 ms of GPU time in bf16 (`benchmarks/binaries.py`,
//! 2026-12-07). Under `--quantize int4` the experts can go to int4 as
//! `gather_qmv` (`quantize::experts`): its decode form was timed with it
//! (1.91 to 1.69 ms, against the linears alone in int4), but its prefill
//! form (every routed row a matrix-vector product) was not, and a kernel
//! change becomes a default only once it was timed on a real GPU, so the
//! experts go to int4 only where `ETMETAL_MOE_INT4=1` is set (at compile
//! time), and stay in float otherwise.

/// `ETMETAL_MOE_INT4=1`: see the module comment.
pub fn int4_experts() -> bool {
    std::env::var("ETMETAL_MOE_INT4").is_ok_and(|v| v == "1")
}
