//! What a preprocess call takes: the options of the compile
//! ([`PreprocessOptions`]) and what the compile driver decided about the
//! partition's boundary ([`Boundary`]). A leaf the lowering context and
//! the driver both read.

use etmetal_graph::ValueId;

use super::coopmat::CoopForm;
use crate::partitioner::DeviceLimits;

/// How preprocess lowers: the binding and fusion budgets, the device
/// limits it keeps within, and the test modes.
#[derive(Clone, Debug)]
pub struct PreprocessOptions {
    /// Storage buffers any kernel may bind: the most the payload requires
    /// of `max_storage_buffers_per_shader_stage` (default 8, wgpu's
    /// default limit; see `budget`).
    pub max_bindings: usize,
    /// Tree nodes a fused expression may inline before it is materialised.
    pub max_fused_size: usize,
    pub max_workgroups_per_dim: u32,
    /// Largest buffer, in bytes as the delegate holds it
    /// ([`gpu_bytes`](crate::payload::gpu_bytes)): the partitioner's
    /// [`DeviceLimits::max_buffer_bytes`], which the compile driver passes
    /// on. Scratch buffers (split-K and key-split partials) stay within
    /// it, so the payload loads wherever the partitioner's values fit.
    pub max_buffer_bytes: u64,
    /// Test and reference mode, never set by `etmetal compile`: where a
    /// product or attention has a tensor-core form `f`, its kernels run in
    /// place of the portable ones, with the cooperative-matrix primitives
    /// emulated in plain WGSL (`coopmat`), so that any adapter
    /// (lavapipe in CI) runs the exact tensor-core kernels, slowly. The
    /// payload then has no alternatives. `None` (the default): the
    /// tensor-core forms are alternatives with their real primitives, which
    /// the runtime runs where the adapter reports them.
    pub emulate_coop: Option<CoopForm>,
    /// Test mode, with `emulate_coop` set to the 16×16 form: which of a
    /// GEMM's tensor-core variants replaces its portable kernel, by index
    /// below [`GEMM_COOP_VARIANTS`](super::GEMM_COOP_VARIANTS) (the first
    /// where that one does not apply). Flash attention takes its smallest.
    pub emulate_variant: usize,
}

impl Default for PreprocessOptions {
    fn default() -> Self {
        PreprocessOptions {
            max_bindings: 8,
            max_fused_size: 64,
            max_workgroups_per_dim: 65535,
            max_buffer_bytes: DeviceLimits::default().max_buffer_bytes,
            emulate_coop: None,
            emulate_variant: 0,
        }
    }
}

impl PreprocessOptions {
    /// These options within the buffer limit of `limits` (what the
    /// partitioner checked the partition's values against): every buffer
    /// of the payload fits where the values were checked to fit.
    pub fn within(&self, limits: &DeviceLimits) -> PreprocessOptions {
        PreprocessOptions {
            max_buffer_bytes: limits.max_buffer_bytes,
            ..self.clone()
        }
    }
}

/// What the compile driver decided about a partition before its
/// preprocess: which mutable buffers stay on the GPU and under which
/// named-data key each weight is stored.
pub struct Boundary<'a> {
    /// Mutable buffers the partition keeps on the GPU: the payload lists
    /// them as [`State`](crate::payload::State), and their new values are no delegate
    /// outputs.
    pub resident: &'a [ResidentBuffer],
    /// The named-data key of a weight, from its value name and GPU bytes.
    pub weight_key: &'a dyn Fn(&str, &[u8]) -> String,
}

/// A mutable buffer a partition reads and writes and keeps on the GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidentBuffer {
    /// Its fully qualified name (`layers.0.k_cache`).
    pub fqn: String,
    /// The buffer: a partition input.
    pub buffer: ValueId,
    /// Its new value: a partition output.
    pub new_value: ValueId,
}

impl Default for Boundary<'_> {
    /// No resident state; weights keyed by their value names.
    fn default() -> Self {
        Boundary {
            resident: &[],
            weight_key: &|name, _| name.to_string(),
        }
    }
}
