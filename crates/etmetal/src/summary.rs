//! What a `.pte` holds, counted: the figures `etmetal inspect` opens with
//! (weights, and per method its calls, what its GPU delegates take and
//! what stays on the CPU), for the command line and for embedders (the C
//! API's counters) alike. It reads the file only.

use std::collections::BTreeMap;

use etmetal_core::Result;
use etmetal_metal::payload::{gpu_bytes, Location, Payload};
use etmetal_metal::BACKEND_ID;
use etmetal_pte::{Instruction, PteFile};

/// The counts of a whole program.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProgramSummary {
    /// Bytes of the constant segment.
    pub constant_bytes: u64,
    /// Bytes of the segments named data lives in (GPU weights), each once.
    pub named_data_bytes: u64,
    /// Named data entries (keys).
    pub named_data_keys: usize,
    /// In the file's order.
    pub methods: Vec<MethodSummary>,
}

/// The counts of one method.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MethodSummary {
    pub name: String,
    pub delegate_calls: usize,
    /// CPU kernel calls by operator (`aten::add.out`), with their counts.
    pub cpu_kernel_calls: BTreeMap<String, usize>,
    /// Instructions that are neither kernel nor delegate calls (moves,
    /// jumps, frees).
    pub other_instructions: usize,
    /// What the `EtMetalBackend` delegates take, summed over them.
    pub gpu: GpuSummary,
    /// Delegates of other backends, by id, with their counts.
    pub other_delegates: BTreeMap<String, usize>,
    /// Bytes of each planned memory (`non_const_buffer_sizes` past the
    /// constant placeholder).
    pub planned_bytes: Vec<u64>,
}

/// The `EtMetalBackend` delegates of one method, summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuSummary {
    pub partitions: usize,
    pub kernels: usize,
    pub dispatches: usize,
    pub weight_bytes: u64,
    pub arena_bytes: u64,
    /// Mutable buffers the delegates keep on the GPU.
    pub state_buffers: usize,
}

impl MethodSummary {
    /// CPU kernel calls of every operator.
    pub fn cpu_calls(&self) -> usize {
        self.cpu_kernel_calls.values().sum()
    }

    /// Each CPU operator with its calls, most called first, then by name.
    pub fn cpu_calls_by_count(&self) -> Vec<(&str, usize)> {
        let mut ops: Vec<(&str, usize)> = (self.cpu_kernel_calls.iter())
            .map(|(op, &n)| (op.as_str(), n))
            .collect();
        ops.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        ops
    }
}

/// `(arena, weight)` bytes of an `EtMetalBackend` payload on the GPU.
pub fn payload_bytes(payload: &Payload) -> (u64, u64) {
    let arena: u64 = payload.arenas.iter().sum();
    let weights: u64 = payload
        .buffers
        .iter()
        .filter(|b| matches!(b.location, Location::Weight { .. }))
        .map(|b| gpu_bytes(b.dtype, b.shape.iter().product()).unwrap_or(0))
        .sum();
    (arena, weights)
}

/// Count what `file` holds (its `EtMetalBackend` payloads are decoded).
pub fn summarize(file: &PteFile) -> Result<ProgramSummary> {
    let program = &file.program;
    let segment_bytes = |i: u32| program.segments.get(i as usize).map_or(0, |s| s.size);
    let constant_bytes = program
        .constant_segment
        .as_ref()
        .map_or(0, |c| segment_bytes(c.segment_index));
    let named: std::collections::BTreeSet<u32> =
        program.named_data.iter().map(|n| n.segment_index).collect();
    let mut methods = Vec::with_capacity(program.execution_plan.len());
    for (p, plan) in program.execution_plan.iter().enumerate() {
        let mut m = MethodSummary {
            name: plan.name.clone(),
            planned_bytes: (plan.non_const_buffer_sizes.iter().skip(1))
                .map(|&n| n.max(0) as u64)
                .collect(),
            ..MethodSummary::default()
        };
        for ins in plan.chains.iter().flat_map(|c| &c.instructions) {
            match ins {
                Instruction::KernelCall(k) => {
                    let op = plan.operators.get(k.op_index as usize);
                    let name = op.map_or_else(|| "?".into(), |o| o.qualified_name());
                    *m.cpu_kernel_calls.entry(name).or_default() += 1;
                }
                Instruction::DelegateCall(_) => m.delegate_calls += 1,
                _ => m.other_instructions += 1,
            }
        }
        for (i, d) in plan.delegates.iter().enumerate() {
            if d.id != BACKEND_ID {
                *m.other_delegates.entry(d.id.clone()).or_default() += 1;
                continue;
            }
            let payload = Payload::decode(file.delegate_data(p, i)?)?;
            let (arena, weights) = payload_bytes(&payload);
            m.gpu.partitions += 1;
            m.gpu.kernels += payload.kernels.len();
            m.gpu.dispatches += payload.dispatches.len();
            m.gpu.state_buffers += payload.state.len();
            m.gpu.arena_bytes += arena;
            m.gpu.weight_bytes += weights;
        }
        methods.push(m);
    }
    Ok(ProgramSummary {
        constant_bytes,
        named_data_bytes: named.iter().map(|&i| segment_bytes(i)).sum(),
        named_data_keys: program.named_data.len(),
        methods,
    })
}
