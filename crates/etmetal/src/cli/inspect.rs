//! `etmetal inspect`: what a program is. A `.pte` opens with a summary
//! (per method: inputs, outputs, what the GPU delegates take, what stays on
//! the CPU, weight and arena bytes); `--verbose` adds the full listing
//! (segments, named data, values, operators, delegates' kernels, every
//! instruction). A `.pt2` shows its signature, weights, op histogram and
//! what the partitioner would delegate.

use std::collections::BTreeMap;
use std::path::Path;

use etmetal::compile::{partition_graph, CompileOptions, Partitioned};
use etmetal::summary::{payload_bytes, summarize};
use etmetal::Model;
use etmetal_core::{Error, Result, Tensor};
use etmetal_graph::{InputKind, OutputKind};
use etmetal_metal::payload::Payload;
use etmetal_pte::{DataLocation, EValue, ExecutionPlan, Instruction, PteFile};

use crate::human_bytes;

/// Inspecting a `.pte` reads the file only: a program whose delegates this
/// build cannot run can still be looked at.
pub fn inspect(out: &mut String, path: &Path, verbose: bool) -> Result<()> {
    say!(out, "{}", path.display());
    if etmetal::is_pte(path)? {
        let file = PteFile::load(path)?;
        summarize_pte(out, &file)?;
        if verbose {
            say!(out, "");
            inspect_pte(out, &file)?;
        }
        Ok(())
    } else {
        let model = Model::load(path)?;
        let graph = model
            .graph()
            .ok_or_else(|| Error::internal("a .pt2 model has a graph"))?;
        inspect_graph(out, graph, path)
    }
}

/// What `compile` (Metal backend, default options) would delegate and what
/// it would leave on the CPU, with the reasons: the partitioner's answer,
/// without compiling any kernel.
fn summarize_partitions(out: &mut String, path: &Path) -> Result<()> {
    let graph = etmetal_graph::load_pt2(path)?;
    let Partitioned {
        graph: g,
        partitioning: parts,
        folded_nodes: folded,
    } = partition_graph(&graph, &CompileOptions::default())?;
    let delegated: usize = parts.partitions.iter().map(|p| p.nodes.len()).sum();
    say!(
        out,
        "{} (compile's default options): {delegated} of {} nodes in {} partition(s); {} on the cpu",
        etmetal_metal::BACKEND_ID,
        g.nodes.len(),
        parts.partitions.len(),
        parts.cpu_nodes.len()
    );
    if folded > 0 {
        say!(
            out,
            "  {folded} node(s) depend on no input: computed at compile time"
        );
    }
    for (i, reason) in &parts.cpu_nodes {
        let node = &g.nodes[*i];
        say!(out, "  cpu: `{}` ({}): {reason}", node.name, node.op.name());
    }
    Ok(())
}

/// `graph` (the `.pt2` at `path`, decomposed): its signature, weights,
/// what the GPU would take, its ops.
fn inspect_graph(out: &mut String, graph: &etmetal_graph::Graph, path: &Path) -> Result<()> {
    say!(out, "inputs:");
    for v in graph.user_inputs() {
        let info = graph.value(v);
        say!(out, "  {}: {} {:?}", info.name, info.dtype, info.shape);
    }
    say!(out, "outputs:");
    for (v, kind) in &graph.outputs {
        let info = graph.value(*v);
        let what = match kind {
            OutputKind::User => String::new(),
            OutputKind::BufferMutation { fqn } => format!(" (new value of buffer {fqn})"),
            OutputKind::UserInputMutation { input_name } => {
                format!(" (mutates input {input_name})")
            }
        };
        say!(
            out,
            "  {}: {} {:?}{what}",
            info.name,
            info.dtype,
            info.shape
        );
    }
    let mut weights = 0usize;
    let mut count = 0usize;
    for (v, kind) in &graph.inputs {
        if *kind != InputKind::User {
            count += 1;
            weights += graph.constants.get(v).map_or(0, Tensor::nbytes);
        }
    }
    say!(
        out,
        "parameters, buffers and constants: {count} tensors, {}",
        human_bytes(weights)
    );
    summarize_partitions(out, path)?;
    let mut histogram: BTreeMap<String, usize> = BTreeMap::new();
    for node in &graph.nodes {
        *histogram.entry(node.op.name().to_string()).or_default() += 1;
    }
    say!(
        out,
        "ops ({} nodes after decomposition, all supported on cpu):",
        graph.nodes.len()
    );
    for (name, n) in histogram {
        say!(out, "  {n:>5}  {name}");
    }
    Ok(())
}

/// An EtMetalBackend payload: its kernels with the ops fused into each,
/// their dispatches and the memory they use.
fn inspect_payload(out: &mut String, payload: &Payload) {
    let (arena, weights) = payload_bytes(payload);
    say!(
        out,
        "    {} kernels, {} dispatches, arena {}, weights {}",
        payload.kernels.len(),
        payload.dispatches.len(),
        human_bytes(arena as usize),
        human_bytes(weights as usize)
    );
    if !payload.state.is_empty() {
        let state: Vec<String> = payload
            .state
            .iter()
            .map(|s| format!("{} (input {})", s.fqn, s.input))
            .collect();
        say!(out, "    state kept on the GPU: {}", state.join(", "));
    }
    let dispatch = |out: &mut String, d: &etmetal_metal::payload::Dispatch, indent: &str| {
        let k = &payload.kernels[d.kernel];
        let [x, y, z] = d.workgroups;
        let [wx, wy, wz] = k.workgroup_size;
        say!(
            out,
            "{indent}{}  [{}]  workgroups {x}x{y}x{z} of {wx}x{wy}x{wz}",
            k.name,
            k.ops.join(", ")
        );
    };
    for d in &payload.dispatches {
        dispatch(out, d, "      ");
        for a in &d.alternatives {
            say!(
                out,
                "        or, where the GPU has cooperative matrices {} and {} bytes of \
                 workgroup memory:",
                a.needs.describe(),
                a.needs.workgroup_storage
            );
            for inner in &a.dispatches {
                dispatch(out, inner, "          ");
            }
        }
    }
}

/// `dtype [shape]` of each of `values` (a plan's inputs or outputs).
fn signature(plan: &ExecutionPlan, values: &[i32]) -> String {
    let all: Vec<String> = values
        .iter()
        .map(|v| match plan.values.get(*v as usize) {
            // a DYNAMIC_BOUND tensor's sizes are upper bounds
            Some(EValue::Tensor(t))
                if t.shape_dynamism != etmetal_pte::TensorShapeDynamism::Static =>
            {
                let spec = etmetal_core::TensorSpec {
                    dtype: t.scalar_type,
                    shape: t.sizes.iter().map(|&s| s.max(0) as usize).collect(),
                    dynamic: vec![true; t.sizes.len()],
                };
                format!("{} {} (dynamic)", t.scalar_type, spec.shape_text())
            }
            Some(EValue::Tensor(t)) => format!("{} {:?}", t.scalar_type, t.sizes),
            Some(other) => format!("{other:?}"),
            None => format!("value {v} (out of range)"),
        })
        .collect();
    if all.is_empty() {
        "none".into()
    } else {
        all.join(", ")
    }
}

/// The answer first: the file's weights, then per method its inputs and
/// outputs, what its GPU delegates take and what stays on the CPU (its
/// kernel calls by operator): `etmetal::summary`'s counts.
fn summarize_pte(out: &mut String, file: &PteFile) -> Result<()> {
    let summary = summarize(file)?;
    say!(
        out,
        "{} method(s); weights {}: constants {}, named data {} ({} keys)",
        summary.methods.len(),
        human_bytes((summary.constant_bytes + summary.named_data_bytes) as usize),
        human_bytes(summary.constant_bytes as usize),
        human_bytes(summary.named_data_bytes as usize),
        summary.named_data_keys
    );
    for (plan, m) in file.program.execution_plan.iter().zip(&summary.methods) {
        say!(out, "method `{}`:", m.name);
        say!(out, "  inputs:  {}", signature(plan, &plan.inputs));
        say!(out, "  outputs: {}", signature(plan, &plan.outputs));
        let calls = m.cpu_calls();
        say!(
            out,
            "  delegated: {} delegate call(s), {calls} CPU kernel call(s){}",
            m.delegate_calls,
            match m.other_instructions {
                0 => String::new(),
                n => format!(", {n} other instruction(s)"),
            }
        );
        let gpu = &m.gpu;
        if gpu.partitions > 0 {
            let state = match gpu.state_buffers {
                0 => String::new(),
                n => format!(", {n} state buffer(s) kept on the GPU"),
            };
            say!(
                out,
                "  GPU ({}): {} partition(s), {} kernels, {} dispatches; \
                 weights {}, arena {}{state}",
                etmetal_metal::BACKEND_ID,
                gpu.partitions,
                gpu.kernels,
                gpu.dispatches,
                human_bytes(gpu.weight_bytes as usize),
                human_bytes(gpu.arena_bytes as usize)
            );
        }
        for (id, n) in &m.other_delegates {
            say!(
                out,
                "  {id}: {n} partition(s) (this build does not run them)"
            );
        }
        let planned: Vec<String> = (m.planned_bytes.iter())
            .map(|&n| human_bytes(n as usize))
            .collect();
        say!(out, "  planned memory: [{}]", planned.join(", "));
        if calls == 0 {
            say!(out, "  on the CPU: nothing");
        } else {
            say!(out, "  on the CPU, by operator:");
            for (op, n) in m.cpu_calls_by_count() {
                say!(out, "    {n:>5}  {op}");
            }
        }
    }
    Ok(())
}

fn inspect_pte(out: &mut String, file: &PteFile) -> Result<()> {
    let program = &file.program;
    say!(out, "segments:");
    for (i, seg) in program.segments.iter().enumerate() {
        say!(
            out,
            "  {i}: offset {} size {}",
            seg.offset,
            human_bytes(seg.size as usize)
        );
    }
    if let Some(constants) = &program.constant_segment {
        say!(
            out,
            "constants: {} buffers in segment {}",
            constants.offsets.len().saturating_sub(1),
            constants.segment_index
        );
    }
    for nd in &program.named_data {
        say!(
            out,
            "named data `{}` -> segment {}",
            nd.key,
            nd.segment_index
        );
    }
    for (p, plan) in program.execution_plan.iter().enumerate() {
        say!(out, "method `{}`:", plan.name);
        let tensor = |v: &i32| match plan.values.get(*v as usize) {
            Some(EValue::Tensor(t)) => format!("{v}: {} {:?}", t.scalar_type, t.sizes),
            Some(other) => format!("{v}: {other:?}"),
            None => format!("{v}: (out of range)"),
        };
        say!(
            out,
            "  inputs:  {}",
            plan.inputs
                .iter()
                .map(tensor)
                .collect::<Vec<_>>()
                .join(", ")
        );
        say!(
            out,
            "  outputs: {}",
            plan.outputs
                .iter()
                .map(tensor)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let arenas: Vec<String> = plan
            .non_const_buffer_sizes
            .iter()
            .skip(1)
            .map(|&n| human_bytes(n as usize))
            .collect();
        say!(
            out,
            "  values: {}, planned arenas: [{}]",
            plan.values.len(),
            arenas.join(", ")
        );
        say!(out, "  operators:");
        for (i, op) in plan.operators.iter().enumerate() {
            say!(out, "    {i}: {}", op.qualified_name());
        }
        for (i, d) in plan.delegates.iter().enumerate() {
            let index = d.processed.index as usize;
            let size = match d.processed.location {
                DataLocation::Segment => program.segments.get(index).map_or(0, |s| s.size as usize),
                DataLocation::Inline => program
                    .backend_delegate_data
                    .get(index)
                    .map_or(0, |b| b.data.len()),
            };
            let specs: Vec<&str> = d.compile_specs.iter().map(|c| c.key.as_str()).collect();
            say!(
                out,
                "  delegate {i}: {} ({}), compile specs [{}]",
                d.id,
                human_bytes(size),
                specs.join(", ")
            );
            if d.id == etmetal_metal::BACKEND_ID {
                inspect_payload(out, &Payload::decode(file.delegate_data(p, i)?)?);
            }
        }
        for (c, chain) in plan.chains.iter().enumerate() {
            say!(
                out,
                "  chain {c}: {} instructions",
                chain.instructions.len()
            );
            for (i, ins) in chain.instructions.iter().enumerate() {
                say!(out, "    {i:>4}  {}", describe(plan, ins));
            }
        }
    }
    Ok(())
}

fn describe(plan: &ExecutionPlan, ins: &Instruction) -> String {
    match ins {
        Instruction::KernelCall(k) => {
            let op = plan
                .operators
                .get(k.op_index as usize)
                .map(|o| o.qualified_name());
            format!("{} {:?}", op.unwrap_or_else(|| "?".into()), k.args)
        }
        Instruction::DelegateCall(d) => format!("delegate {} {:?}", d.delegate_index, d.args),
        Instruction::MoveCall(m) => format!("move {} -> {}", m.move_from, m.move_to),
        Instruction::JumpFalseCall(j) => {
            format!(
                "jump to {} if value {} is false",
                j.destination_instruction, j.cond_value_index
            )
        }
        Instruction::FreeCall(f) => format!("free {}", f.value_index),
    }
}
