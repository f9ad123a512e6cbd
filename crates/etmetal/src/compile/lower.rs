//! One method from a graph to what [`emit`](super::emit) writes: the
//! backend's front half ([`for_backend`]: decompose all but the ops the GPU
//! takes whole, fold input-free nodes, remove dead code, partition), the
//! decisions made before any preprocess (which mutable buffers a partition
//! keeps on the GPU, under which named-data key each weight is stored:
//! [`Boundary`]), each partition preprocessed into a payload and replaced by
//! one delegate-call node, then the CPU rest (decompose everything, fold
//! again, fold batch norms into convolutions, [`to_portable`], dead code).

use std::collections::HashSet;

use etmetal_core::{Error, Op, Result};
use etmetal_graph::portable::to_portable;
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::{
    ops_to_not_decompose, partition, Partition, PartitionOptions, Partitioning, ScheduleItem,
};
use etmetal_metal::preprocess::{preprocess_with, Boundary, ResidentBuffer};
use etmetal_pte::NamedDataStore;

use super::emit::{buffer_fqn, LoweredMethod};
use super::{Backend, CompileOptions, MethodReport, PartitionReport};

/// The backend's front half on `g`: everything but the ops the GPU takes
/// whole decomposed, nodes that depend on no input folded into constants
/// (`state`: buffers the program mutates, never folded), dead code
/// removed; then partitioned. Returns the partitioning and how many nodes
/// were folded.
pub(super) fn for_backend(
    g: &mut Graph,
    options: &CompileOptions,
    state: &[String],
) -> Result<(Partitioning, usize)> {
    etmetal_graph::decompose(g, &ops_to_not_decompose);
    let folded = etmetal_graph::fold_constants(g, state)?;
    etmetal_graph::eliminate_dead_code(g);
    let within = PartitionOptions {
        state: state.to_vec(),
        ..options.partition.clone()
    };
    Ok((partition(g, &within)?, folded))
}

/// Lower one method; its delegates' weights go to `named_data`, which
/// holds the methods lowered before it (a weight stored there under the
/// same name with other bytes gets a key of this method's own). `state`:
/// the buffers any method of the program mutates.
pub(super) fn lower(
    name: &str,
    mut g: Graph,
    state: &[String],
    options: &CompileOptions,
    named_data: &mut NamedDataStore,
    progress: &mut dyn FnMut(&str),
) -> Result<(LoweredMethod, MethodReport)> {
    check_signature(&g)?;
    let unread_state = unread_state(&g)?;
    let mut payloads = vec![];
    let mut reports = vec![];
    let mut cpu_nodes = vec![];
    let mut resident = vec![];
    let mut folded = 0;
    if options.backend == Backend::Metal {
        let (parts, n) = for_backend(&mut g, options, state)?;
        folded += n;
        for (i, reason) in &parts.cpu_nodes {
            let node = &g.nodes[*i];
            cpu_nodes.push((
                node.name.clone(),
                node.op.name().to_string(),
                reason.clone(),
            ));
        }
        let kept = resident_buffers(&g, &parts)?;
        let pre_options = options.preprocess();
        for p in &parts.partitions {
            let here: Vec<ResidentBuffer> = kept
                .iter()
                .filter(|(part, _)| *part == p.id)
                .map(|(_, r)| r.clone())
                .collect();
            let store = &*named_data;
            let boundary = Boundary {
                resident: &here,
                weight_key: &|key, bytes| store.key_for(key, bytes, name),
            };
            let pre = preprocess_with(&g, p, &pre_options, &boundary)
                .map_err(|e| e.context(format!("partition {} of the Metal backend", p.tag())))?;
            for (key, bytes) in pre.named_data {
                named_data.insert(key, bytes)?;
            }
            let payload = pre.payload.encode();
            progress(&format!(
                "{name}: partition {}: {} nodes → {} kernels, {} dispatches",
                p.tag(),
                p.nodes.len(),
                pre.payload.kernels.len(),
                pre.payload.dispatches.len()
            ));
            reports.push(PartitionReport {
                tag: p.tag(),
                nodes: p.nodes.iter().map(|&i| g.nodes[i].name.clone()).collect(),
                payload: pre.payload,
                payload_bytes: payload.len(),
            });
            payloads.push(payload);
            resident.extend(here);
        }
        // a resident buffer's new value is no method output: no `copy_`
        g.outputs
            .retain(|(v, _)| !resident.iter().any(|r| r.new_value == *v));
        g = with_delegate_calls(&g, &parts, &resident);
    }
    etmetal_graph::decompose(&mut g, &|_| false);
    folded += etmetal_graph::fold_constants(&mut g, state)?;
    etmetal_graph::fold_conv_affine(&mut g)?;
    to_portable(&mut g)?;
    etmetal_graph::eliminate_dead_code(&mut g);
    Ok((
        LoweredMethod {
            name: name.to_string(),
            graph: g,
            payloads,
            resident: resident.iter().map(|r| r.buffer).collect(),
            unread_state,
        },
        MethodReport {
            name: name.to_string(),
            partitions: reports,
            cpu_nodes,
            resident_state: resident.into_iter().map(|r| r.fqn).collect(),
            folded_nodes: folded,
        },
    ))
}

/// The mutated buffers (by name) whose value before the call `g` never
/// reads: no node and no output takes the buffer input itself.
fn unread_state(g: &Graph) -> Result<HashSet<String>> {
    let mut out = HashSet::new();
    for (buffer, _) in g.buffer_mutations()? {
        let read = g.nodes.iter().any(|n| n.inputs.contains(&Some(buffer)))
            || g.outputs.iter().any(|(v, _)| *v == buffer);
        if !read {
            out.insert(buffer_fqn(g, buffer)?);
        }
    }
    Ok(out)
}

/// `(partition, buffer)` of each mutated buffer that one partition reads
/// and writes and nothing else touches: no CPU node or other partition
/// reads the buffer or its new value, neither is a user output. That
/// partition can keep it on the GPU.
fn resident_buffers(g: &Graph, parts: &Partitioning) -> Result<Vec<(usize, ResidentBuffer)>> {
    let user_outputs: Vec<ValueId> = g.user_outputs().collect();
    let mut out = vec![];
    for (buffer, new) in g.buffer_mutations()? {
        let readers: Vec<usize> = parts
            .partitions
            .iter()
            .filter(|p| p.inputs.contains(&buffer) || p.inputs.contains(&new))
            .map(|p| p.id)
            .collect();
        let on_cpu = parts.cpu_nodes.iter().any(|(i, _)| {
            g.nodes[*i]
                .inputs
                .iter()
                .flatten()
                .any(|&v| v == buffer || v == new)
        });
        let Some(part) = parts.partitions.iter().find(|p| p.outputs.contains(&new)) else {
            continue;
        };
        if readers == [part.id]
            && !on_cpu
            && !user_outputs.contains(&buffer)
            && !user_outputs.contains(&new)
        {
            let resident = ResidentBuffer {
                fqn: buffer_fqn(g, buffer)?,
                buffer,
                new_value: new,
            };
            out.push((part.id, resident));
        }
    }
    Ok(out)
}

/// `g` with each partition replaced by one [`Op::Delegate`] node, nodes in
/// the partitioner's schedule; the call writes the partition's outputs but
/// the new values of the buffers it keeps.
fn with_delegate_calls(g: &Graph, parts: &Partitioning, resident: &[ResidentBuffer]) -> Graph {
    let call = |p: &Partition| Node {
        name: format!("executorch_call_delegate_{}", p.id),
        target: "executorch_call_delegate".into(),
        op: Op::Delegate { index: p.id },
        inputs: p.inputs.iter().copied().map(Some).collect(),
        outputs: (p.outputs.iter().copied())
            .filter(|v| !resident.iter().any(|r| r.new_value == *v))
            .collect(),
    };
    let mut out = g.clone();
    out.nodes = (parts.schedule.iter())
        .map(|step| match *step {
            ScheduleItem::Cpu(i) => g.nodes[i].clone(),
            ScheduleItem::Delegate(id) => call(&parts.partitions[id]),
        })
        .collect();
    out
}

/// What the `.pte` cannot express: mutated user inputs, mutated buffers
/// without an initial value, parameters without data.
fn check_signature(g: &Graph) -> Result<()> {
    for (v, kind) in &g.outputs {
        if let OutputKind::UserInputMutation { input_name } = kind {
            return Err(Error::unsupported(format!(
                "output `{}` mutates user input `{input_name}`: only buffers keep state in a .pte",
                g.value(*v).name
            )));
        }
    }
    for (buffer, _) in g.buffer_mutations()? {
        if !g.constants.contains_key(&buffer) {
            return Err(Error::invalid_input(format!(
                "mutated buffer `{}` has no initial value",
                buffer_fqn(g, buffer)?
            )));
        }
    }
    for (v, kind) in &g.inputs {
        if *kind != InputKind::User && !g.constants.contains_key(v) {
            return Err(Error::invalid_input(format!(
                "input `{}` ({kind:?}) has no data",
                g.value(*v).name
            )));
        }
    }
    Ok(())
}
