//! `etmetal compile`: the pipeline from a graph to an ExecuTorch `.pte`.
//!
//! With the Metal backend: decompose all but the ops the backend takes
//! whole → fold the nodes that depend on no input into constants
//! ([`fold_constants`](etmetal_graph::fold_constants)) → partition → decide, before any preprocess, which mutable
//! buffers a partition keeps on the GPU and under which named-data key each
//! weight is stored ([`Boundary`]) → [`preprocess_with`] each partition
//! into a delegate payload → replace each partition by one delegate-call
//! node. Then, for what stays on the CPU: decompose everything → fold
//! input-free nodes again (with the CPU backend, the only time) → fold
//! batch-norm scales and shifts into the convolutions before them →
//! [`to_portable`] → dead-code elimination. The [`emit`](crate::emit)
//! module writes the methods, payloads and named data as one `.pte`; with
//! the CPU backend the file runs in ExecuTorch's own runtime.
//!
//! [`compile_methods`] writes several methods (ExecuTorch's
//! `to_edge({"forward": decode, "prefill": prefill})`), each its own
//! execution plan; mutable buffers of one name are one state in all of
//! them. A mutable buffer that only one GPU partition reads and writes is
//! kept on the GPU: the partition's payload lists it as
//! [`etmetal_metal::payload::State`], its new value is no delegate output
//! and the chain has no `copy_` for it.

use std::collections::HashSet;
use std::path::Path;

use etmetal_core::{Error, Op, Result};
use etmetal_graph::portable::to_portable;
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::{
    ops_to_not_decompose, partition, Partition, PartitionOptions, Partitioning, ScheduleItem,
};
use etmetal_metal::payload::Payload;
use etmetal_metal::preprocess::{preprocess_with, Boundary, PreprocessOptions, ResidentBuffer};
use etmetal_pte::NamedDataStore;

use crate::emit::{buffer_fqn, write_program, LoweredMethod};

/// Where the compiled program runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// GPU partitions through the Metal delegate, the rest on CPU kernels.
    #[default]
    Metal,
    /// ExecuTorch portable kernels only.
    Cpu,
}

#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    pub backend: Backend,
    pub partition: PartitionOptions,
    /// Preprocess's options; its `max_buffer_bytes` is the partition's
    /// `limits.max_buffer_bytes`, whatever it says here.
    pub preprocess: PreprocessOptions,
}

/// One delegated partition of a compiled method, for reports.
#[derive(Clone, Debug)]
pub struct PartitionReport {
    /// `tag0`, `tag1`, … as ExecuTorch tags delegated nodes.
    pub tag: String,
    /// The delegated nodes' names.
    pub nodes: Vec<String>,
    pub payload: Payload,
    pub payload_bytes: usize,
}

/// A compiled program and what went where, per method.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub pte: Vec<u8>,
    pub methods: Vec<MethodReport>,
}

/// What went where in one method.
#[derive(Clone, Debug)]
pub struct MethodReport {
    pub name: String,
    pub partitions: Vec<PartitionReport>,
    /// Nodes left on the CPU: `(node, op, reason)`.
    pub cpu_nodes: Vec<(String, String, String)>,
    /// Fully qualified names of the mutable buffers kept on the GPU.
    pub resident_state: Vec<String>,
    /// Nodes that depend on no input, computed at compile time.
    pub folded_nodes: usize,
}

/// Import the `.pt2` at `path` and compile it with [`compile_cpu`].
pub fn compile_pt2_cpu(path: &Path) -> Result<Vec<u8>> {
    let graph = etmetal_graph::load_pt2(path)?;
    compile_cpu(&graph).map_err(|e| e.context(format!("compiling {}", path.display())))
}

/// The bytes of a `.pte` computing `graph` with ExecuTorch portable kernels.
pub fn compile_cpu(graph: &Graph) -> Result<Vec<u8>> {
    let options = CompileOptions {
        backend: Backend::Cpu,
        ..CompileOptions::default()
    };
    Ok(compile(graph, &options, &mut |_| {})?.pte)
}

/// Compile `graph` as method `forward`; `progress` hears one line per
/// partition compiled.
pub fn compile(
    graph: &Graph,
    options: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Compiled> {
    compile_methods(&[("forward", graph)], options, progress)
}

/// Compile each `(name, graph)` as one method of one program. Mutable
/// buffers of the same fully qualified name are one state: they must agree
/// in dtype, shape and initial value.
pub fn compile_methods(
    methods: &[(&str, &Graph)],
    options: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Compiled> {
    if methods.is_empty() {
        return Err(Error::invalid_input("a program needs at least one method"));
    }
    let mut lowered = Vec::with_capacity(methods.len());
    let mut reports = Vec::with_capacity(methods.len());
    let mut named_data = NamedDataStore::new();
    // buffers any method writes: state in every method
    let state: Vec<String> = (methods.iter())
        .flat_map(|(_, g)| &g.outputs)
        .filter_map(|(_, kind)| match kind {
            OutputKind::BufferMutation { fqn } => Some(fqn.clone()),
            _ => None,
        })
        .collect();
    for (k, (name, graph)) in methods.iter().enumerate() {
        if name.is_empty() || methods[..k].iter().any(|(n, _)| n == name) {
            return Err(Error::invalid_input(format!(
                "method name `{name}` is empty or given twice"
            )));
        }
        let (l, r) = lower(name, graph, &state, options, &mut named_data, progress)
            .map_err(|e| e.context(format!("method `{name}`")))?;
        lowered.push(l);
        reports.push(r);
    }
    Ok(Compiled {
        pte: write_program(&lowered, &named_data)?,
        methods: reports,
    })
}

/// Lower one method; its delegates' weights go to `named_data`, which
/// holds the methods lowered before it (a weight stored there under the
/// same name with other bytes gets a key of this method's own). `state`:
/// the buffers any method of the program mutates.
fn lower(
    name: &str,
    graph: &Graph,
    state: &[String],
    options: &CompileOptions,
    named_data: &mut NamedDataStore,
    progress: &mut dyn FnMut(&str),
) -> Result<(LoweredMethod, MethodReport)> {
    let mut g = graph.clone();
    check_signature(&g)?;
    let unread_state = unread_state(&g)?;
    let mut payloads = vec![];
    let mut reports = vec![];
    let mut cpu_nodes = vec![];
    let mut resident = vec![];
    let mut folded = 0;
    if options.backend == Backend::Metal {
        etmetal_graph::decompose(&mut g, &ops_to_not_decompose);
        folded += etmetal_graph::fold_constants(&mut g, state)?;
        etmetal_graph::eliminate_dead_code(&mut g);
        let within = PartitionOptions {
            state: state.to_vec(),
            ..options.partition.clone()
        };
        let parts = partition(&g, &within)?;
        for (i, reason) in &parts.cpu_nodes {
            let node = &g.nodes[*i];
            cpu_nodes.push((
                node.name.clone(),
                node.op.name().to_string(),
                reason.clone(),
            ));
        }
        let kept = resident_buffers(&g, &parts)?;
        let pre_options = options.preprocess.within(&options.partition.limits);
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

#[cfg(test)]
mod tests {
    use super::*;
    use etmetal_core::DType;
    use etmetal_pte::{EValue, Instruction, KernelCall, TensorShapeDynamism};
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
    }

    #[test]
    fn fixtures_compile_and_parse_back() {
        for name in [
            "mlp",
            "mlp_decomposed",
            "bf16_mlp",
            "resblock",
            "resblock_decomposed",
            "gpt_block",
            "gpt_block_decomposed",
            "transposed_weight",
        ] {
            let bytes = compile_pt2_cpu(&fixture(&format!("{name}.pt2")))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let pte = etmetal_pte::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            let plan = &pte.program.execution_plan[0];
            assert_eq!(plan.name, "forward");
            assert_eq!(plan.inputs.len(), 1, "{name}");
            assert_eq!(plan.non_const_buffer_sizes.len(), 2);
            assert!(plan.non_const_buffer_sizes[1] > 0);
            // every operator is an out variant the portable library has
            for op in &plan.operators {
                assert!(op.name.starts_with("aten::"), "{name}: {op:?}");
            }
            let Instruction::KernelCall(first) = &plan.chains[0].instructions[0] else {
                panic!("{name}: not a kernel call")
            };
            assert!(!first.args.is_empty());
        }
    }

    #[test]
    fn dynamic_shapes_are_bound_tensors_and_sizes_computed_at_run_time() {
        let bytes = compile_pt2_cpu(&fixture("dynamic/gpt_block_seq.pt2")).unwrap();
        let pte = etmetal_pte::parse(&bytes).unwrap();
        let plan = &pte.program.execution_plan[0];
        let tensor = |i: i32| match &plan.values[i as usize] {
            EValue::Tensor(t) => t.clone(),
            other => panic!("value {i} is {other:?}"),
        };
        let x = tensor(plan.inputs[0]);
        assert_eq!(x.sizes, [1, 16, 16]);
        assert_eq!(x.shape_dynamism, TensorShapeDynamism::DynamicBound);
        assert_eq!(
            tensor(plan.outputs[0]).shape_dynamism,
            TensorShapeDynamism::DynamicBound
        );
        // weights are static
        assert!(plan.values.iter().any(|v| matches!(v,
            EValue::Tensor(t) if t.data_buffer_idx > 0 && t.shape_dynamism == TensorShapeDynamism::Static)));
        let names: Vec<String> = plan
            .operators
            .iter()
            .map(|o| format!("{}.{}", o.name, o.overload))
            .collect();
        assert!(
            names.contains(&"aten::sym_size.int".to_string()),
            "{names:?}"
        );
        // the sequence length is read once, from the input's dim 1, and
        // every int list naming it names that value
        let sym_size = names
            .iter()
            .position(|n| n == "aten::sym_size.int")
            .unwrap() as i32;
        let calls: Vec<&KernelCall> = plan.chains[0]
            .instructions
            .iter()
            .filter_map(|i| match i {
                Instruction::KernelCall(k) if k.op_index == sym_size => Some(k),
                _ => None,
            })
            .collect();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].args[0], plan.inputs[0]);
        assert_eq!(plan.values[calls[0].args[1] as usize], EValue::Int(1));
        let seq = calls[0].args[2];
        let named = plan
            .values
            .iter()
            .any(|v| matches!(v, EValue::IntList(items) if items.contains(&(seq as i64))));
        assert!(named, "no int list names the sequence length");
        // the static program is unchanged by the dynamic support
        let fixed = compile_pt2_cpu(&fixture("gpt_block.pt2")).unwrap();
        let fixed = etmetal_pte::parse(&fixed).unwrap();
        assert!(fixed.program.execution_plan[0]
            .values
            .iter()
            .all(|v| !matches!(v,
            EValue::Tensor(t) if t.shape_dynamism != TensorShapeDynamism::Static)));
    }

    #[test]
    fn input_mutation_and_buffer_without_data_are_refused() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![2]);
        g.inputs.push((x, InputKind::User));
        g.outputs.push((
            x,
            OutputKind::UserInputMutation {
                input_name: "x".into(),
            },
        ));
        let e = compile_cpu(&g).unwrap_err().to_string();
        assert!(e.contains("mutates user input"), "{e}");
        g.outputs[0].1 = OutputKind::BufferMutation { fqn: "b".into() };
        let e = compile_cpu(&g).unwrap_err().to_string();
        assert!(e.contains("not an input"), "{e}");
    }
}
