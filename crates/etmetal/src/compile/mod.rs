//! The compiler: from `torch.export` graphs to an ExecuTorch `.pte`, one
//! pipeline for the `etmetal compile` command, `inspect`, the Python
//! plug-in and the Rust API, all driven by one [`CompileOptions`].
//!
//! 1. Options on the graph ([`apply_options`]): `--dtype`
//!    (`etmetal_graph::precision`), `--quantize` over all methods at once
//!    ([`quantize`], calibrated by [`crate::calibrate`]).
//! 2. Per method ([`lower`]), with the Metal backend: the front half
//!    (decompose, fold, dead code, partition), the decisions made before
//!    preprocess (resident state, weight keys), each partition
//!    preprocessed and replaced by a delegate call; then the CPU rest.
//! 3. [`emit`] writes the methods, payloads and named data as one `.pte`;
//!    with the CPU backend the file runs in ExecuTorch's own runtime.
//!
//! [`compile_methods`] writes several methods (ExecuTorch's
//! `to_edge({"forward": decode, "prefill": prefill})`), each its own
//! execution plan; mutable buffers of one name are one state in all of
//! them. A mutable buffer that only one GPU partition reads and writes is
//! kept on the GPU: the partition's payload lists it as
//! [`etmetal_metal::payload::State`], its new value is no delegate output
//! and the chain has no `copy_` for it. [`partition_graph`] stops after the
//! partitioner (`inspect`, the plug-in's partitioner) and
//! [`delegate_payload`] makes one program one payload (the plug-in's
//! `preprocess`).

mod emit;
mod lower;
mod options;
mod quantize;

use std::path::Path;

use etmetal_core::{Error, Result};
use etmetal_graph::{Graph, OutputKind};
use etmetal_metal::partitioner::{PartitionMode, PartitionOptions, Partitioning};
use etmetal_metal::payload::Payload;
use etmetal_metal::preprocess::{preprocess, Preprocessed};
use etmetal_pte::NamedDataStore;

pub use options::{Backend, CalibrationText, CompileOptions, Quantization};

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
/// in dtype, shape and initial value. `progress` hears what quantization
/// did and one line per partition compiled.
pub fn compile_methods(
    methods: &[(&str, &Graph)],
    options: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Compiled> {
    compile_prepared(prepare(methods, options, progress)?, options, progress)
}

/// A program's methods with the options that rewrite a graph applied
/// (`dtype`, quantization): [`compile_methods`] halfway, for a caller that
/// looks at what quantization found before compiling on.
pub struct Prepared {
    methods: Vec<(String, Graph)>,
    /// The buffers any method mutates (before the options).
    state: Vec<String>,
    /// Per method, the linears quantization found (quantized or kept in
    /// float); 0 without quantization.
    pub linears: Vec<usize>,
}

/// The first half of [`compile_methods`]: the methods checked, their
/// graphs with the options applied.
pub fn prepare(
    methods: &[(&str, &Graph)],
    options: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Prepared> {
    if methods.is_empty() {
        return Err(Error::invalid_input("a program needs at least one method"));
    }
    for (k, (name, _)) in methods.iter().enumerate() {
        if name.is_empty() || methods[..k].iter().any(|(n, _)| n == name) {
            return Err(Error::invalid_input(format!(
                "method name `{name}` is empty or given twice"
            )));
        }
    }
    let state = program_state(methods.iter().map(|(_, g)| *g));
    let (graphs, linears) = apply_options(methods, options, progress)?;
    Ok(Prepared {
        methods: (methods.iter().map(|(name, _)| name.to_string()))
            .zip(graphs)
            .collect(),
        state,
        linears,
    })
}

/// The second half of [`compile_methods`]: each prepared method lowered,
/// the program written.
pub fn compile_prepared(
    prepared: Prepared,
    options: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Compiled> {
    let lowered = lower_prepared(prepared, options, progress)?;
    Ok(Compiled {
        pte: emit::write_program(&lowered.methods, &lowered.named_data)?,
        methods: lowered.reports,
    })
}

/// A program lowered, not yet written: [`compile_prepared`] before the
/// bytes, for a caller that writes them to a file ([`Lowered::write_file`]).
pub struct Lowered {
    methods: Vec<emit::LoweredMethod>,
    named_data: NamedDataStore,
    /// What went where, per method.
    pub reports: Vec<MethodReport>,
}

impl Lowered {
    /// The `.pte` [`compile_prepared`] makes, written to a file at `path`
    /// a piece at a time (the program, then each payload and weight from
    /// its own bytes): never whole in memory, and no file where the
    /// program fails its checks. Returns its size in bytes.
    pub fn write_file(&self, path: &Path) -> Result<u64> {
        emit::write_program_file(&self.methods, &self.named_data, path)
    }
}

/// [`compile_prepared`] up to the writing: each prepared method lowered.
pub fn lower_prepared(
    prepared: Prepared,
    options: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Lowered> {
    let mut lowered = Vec::with_capacity(prepared.methods.len());
    let mut reports = Vec::with_capacity(prepared.methods.len());
    let mut named_data = NamedDataStore::new();
    for (name, graph) in prepared.methods {
        let (l, r) = lower::lower(
            &name,
            graph,
            &prepared.state,
            options,
            &mut named_data,
            progress,
        )
        .map_err(|e| e.context(format!("method `{name}`")))?;
        lowered.push(l);
        reports.push(r);
    }
    Ok(Lowered {
        methods: lowered,
        named_data,
        reports,
    })
}

/// The buffers any of `graphs` writes: state in every method, never folded
/// into a constant or baked into a payload.
fn program_state<'g>(graphs: impl Iterator<Item = &'g Graph>) -> Vec<String> {
    graphs
        .flat_map(|g| &g.outputs)
        .filter_map(|(_, kind)| match kind {
            OutputKind::BufferMutation { fqn } => Some(fqn.clone()),
            _ => None,
        })
        .collect()
}

/// The methods' graphs with the options that rewrite a graph applied:
/// `dtype`, then quantization over all of them (the weights they share are
/// quantized once), then the linears of one input merged
/// (`etmetal_graph::siblings`). Also returns how many linears quantization
/// found in each (0 without it).
fn apply_options(
    methods: &[(&str, &Graph)],
    options: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Graph>, Vec<usize>)> {
    options.check()?;
    let mut graphs = Vec::with_capacity(methods.len());
    for (name, graph) in methods {
        let mut g = (*graph).clone();
        etmetal_graph::precision::convert_floats(&mut g, options.dtype)
            .map_err(|e| e.context(format!("method `{name}`")))?;
        graphs.push(g);
    }
    let linears = match &options.quantize {
        Some(q) => {
            let names: Vec<&str> = methods.iter().map(|(name, _)| *name).collect();
            quantize::quantize_methods(q, &names, &mut graphs, progress)?
        }
        None => vec![0; graphs.len()],
    };
    // linears of one input as one product (after quantization, which
    // picks formats and skips by each linear's own name)
    for (g, (name, _)) in graphs.iter_mut().zip(methods) {
        etmetal_graph::siblings::merge(g).map_err(|e| e.context(format!("method `{name}`")))?;
    }
    Ok((graphs, linears))
}

/// A graph as the Metal backend partitions it, and the partitioner's answer.
pub struct Partitioned {
    /// The graph after the options and the backend's front half
    /// (decomposed, folded, dead code removed): the partitioning's node
    /// indices are into it.
    pub graph: Graph,
    pub partitioning: Partitioning,
    /// Nodes that depend on no input, computed at compile time.
    pub folded_nodes: usize,
}

/// What [`compile`] would delegate of `graph` and what it would leave on
/// the CPU, with the reasons, without compiling any kernel.
pub fn partition_graph(graph: &Graph, options: &CompileOptions) -> Result<Partitioned> {
    let state = program_state(std::iter::once(graph));
    let (mut graphs, _) = apply_options(&[("forward", graph)], options, &mut |_| {})?;
    let mut g = graphs.remove(0);
    let (partitioning, folded_nodes) = lower::for_backend(&mut g, options, &state)?;
    Ok(Partitioned {
        graph: g,
        partitioning,
        folded_nodes,
    })
}

/// `graph`, a whole program, as one delegate payload and its named data
/// (ExecuTorch's `preprocess` of a partition): the payload's inputs and
/// outputs are the program's user inputs and outputs in signature order,
/// as ExecuTorch's delegate call passes them. An error unless the
/// partitioner takes all of it as one partition.
pub fn delegate_payload(graph: &Graph, options: &CompileOptions) -> Result<Preprocessed> {
    let whole = CompileOptions {
        partition: PartitionOptions {
            mode: PartitionMode::Whole,
            ..options.partition.clone()
        },
        ..options.clone()
    };
    let Partitioned {
        graph: g,
        partitioning: mut parts,
        ..
    } = partition_graph(graph, &whole)?;
    if parts.partitions.len() != 1 {
        return Err(Error::unsupported(format!(
            "the lowered program makes {} partitions, expected exactly one",
            parts.partitions.len()
        )));
    }
    let mut p = parts.partitions.remove(0);
    p.inputs = g.user_inputs().collect();
    p.outputs = (g.outputs.iter())
        .filter(|(_, kind)| *kind == OutputKind::User)
        .map(|(v, _)| *v)
        .collect();
    preprocess(&g, &p, &whole.preprocess())
}

#[cfg(test)]
mod tests {
    use super::*;
    use etmetal_core::DType;
    use etmetal_graph::InputKind;
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
