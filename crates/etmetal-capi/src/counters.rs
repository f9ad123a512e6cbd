//! The counts `etmetal inspect` opens with (`etmetal::summary`), for a
//! program and for each method, in their C form. A leaf: the functions
//! that hand them out live beside the handles they read (`program.rs`,
//! `method.rs`).

use std::ffi::CString;

use etmetal::summary::{MethodSummary, ProgramSummary};
use etmetal_core::{Error, Result};

/// What a program holds, as `etmetal inspect` counts it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EtmetalProgramCounters {
    pub methods: usize,
    /// Bytes of the constant segment (weights the CPU kernels read).
    pub constant_bytes: u64,
    /// Bytes of named data (weights of the GPU delegates), each segment once.
    pub named_data_bytes: u64,
    /// Named data entries.
    pub named_data_keys: usize,
}

impl EtmetalProgramCounters {
    pub(crate) fn of(s: &ProgramSummary) -> EtmetalProgramCounters {
        EtmetalProgramCounters {
            methods: s.methods.len(),
            constant_bytes: s.constant_bytes,
            named_data_bytes: s.named_data_bytes,
            named_data_keys: s.named_data_keys,
        }
    }
}

/// What a method does, as `etmetal inspect` counts it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EtmetalMethodCounters {
    pub delegate_calls: usize,
    /// CPU kernel calls, of `cpu_operators` distinct operators
    /// (`etmetal_method_cpu_operator` lists them).
    pub cpu_kernel_calls: usize,
    pub cpu_operators: usize,
    /// Instructions that are neither kernel nor delegate calls.
    pub other_instructions: usize,
    /// What the `EtMetalBackend` (GPU) delegates take.
    pub gpu_partitions: usize,
    pub gpu_kernels: usize,
    pub gpu_dispatches: usize,
    pub gpu_weight_bytes: u64,
    pub gpu_arena_bytes: u64,
    /// Mutable buffers (a KV cache) the GPU delegates keep on the GPU.
    pub gpu_state_buffers: usize,
    /// Delegates of other backends, which this library does not run.
    pub other_delegates: usize,
    /// Planned memory: how many arenas, and their bytes in all.
    pub planned_memories: usize,
    pub planned_bytes: u64,
}

/// A method's counts, with the names `etmetal_method_cpu_operator` lends.
pub(crate) struct MethodCounts {
    counters: EtmetalMethodCounters,
    /// By calls, most first, then by name (as `inspect` lists them).
    cpu_operators: Vec<(CString, usize)>,
}

impl MethodCounts {
    pub(crate) fn of(m: &MethodSummary) -> Result<MethodCounts> {
        let cpu_operators = (m.cpu_calls_by_count().into_iter())
            .map(|(name, n)| {
                let name = CString::new(name)
                    .map_err(|_| Error::format(format!("a NUL byte in operator `{name}`")))?;
                Ok((name, n))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MethodCounts {
            counters: EtmetalMethodCounters {
                delegate_calls: m.delegate_calls,
                cpu_kernel_calls: m.cpu_calls(),
                cpu_operators: cpu_operators.len(),
                other_instructions: m.other_instructions,
                gpu_partitions: m.gpu.partitions,
                gpu_kernels: m.gpu.kernels,
                gpu_dispatches: m.gpu.dispatches,
                gpu_weight_bytes: m.gpu.weight_bytes,
                gpu_arena_bytes: m.gpu.arena_bytes,
                gpu_state_buffers: m.gpu.state_buffers,
                other_delegates: m.other_delegates.values().sum(),
                planned_memories: m.planned_bytes.len(),
                planned_bytes: m.planned_bytes.iter().sum(),
            },
            cpu_operators,
        })
    }

    pub(crate) fn counters(&self) -> EtmetalMethodCounters {
        self.counters
    }

    /// The CPU operators the method calls with their calls, most calls
    /// first.
    pub(crate) fn cpu_operators(&self) -> &[(CString, usize)] {
        &self.cpu_operators
    }
}
