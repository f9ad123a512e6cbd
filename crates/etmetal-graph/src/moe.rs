//! Whether a mixture-of-experts layer's grouped matmul reads only its
//! routed experts: the importer's sparse form of a decode step's grouped
//! matmul (`pt2::lower::composite`, `grouped_mm_sparse`) and, under
//! `--quantize int4`, its experts in int4 as `gather_qmv`
//! (`quantize::experts`). Both change which GPU kernels a MoE program
//! runs, and a kernel change becomes a default only once it was timed on a
//! real GPU, which these have not been yet: until then they are taken
//! where `ETMETAL_MOE_ROUTED=1` is set (at compile time), and every MoE
//! layer otherwise computes every expert's product, as before.

/// `ETMETAL_MOE_ROUTED=1`: see the module comment.
pub fn routed_experts() -> bool {
    std::env::var("ETMETAL_MOE_ROUTED").is_ok_and(|v| v == "1")
}
