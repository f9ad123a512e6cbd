//! `etmetal compile`: lower a graph to an ExecuTorch `.pte`.
//!
//! Pipeline: with the Metal backend, decompose all but the ops the backend
//! takes whole → partition → [`preprocess`] each partition into a delegate
//! payload (its weights into named data) → replace each partition by one
//! delegate-call node. Then, for what stays on the CPU: decompose everything
//! → fold batch-norm scales and shifts into the convolutions before them
//! → [`to_portable`] → dead-code elimination → memory planning (one arena,
//! `mem_id` 1) → one `forward` plan with one chain of `KernelCall`s (from
//! `etmetal_pte::kernels::encode`) and `DelegateCall`s → constants stored
//! once in the constant segment → [`etmetal_pte::serialize`]. With the CPU
//! backend the file runs in ExecuTorch's own runtime.
//!
//! [`compile_methods`] writes several methods (ExecuTorch's
//! `to_edge({"forward": decode, "prefill": prefill})`), each its own
//! execution plan. Mutable buffers are laid out as ExecuTorch's
//! `share_mutable_buffers=True` does: planned memory `mem_id` 2, one range
//! per fully qualified name at the same offset in every method, the name in
//! `extra_tensor_info`, the initial value stored once. A mutable buffer that
//! only one GPU partition reads and writes is kept on the GPU: the
//! partition's payload lists it as [`etmetal_metal::payload::State`], its new
//! value is no delegate output and the chain has no `copy_` for it.

use std::collections::HashMap;
use std::path::Path;

use etmetal_core::{DType, Error, Op, Result, Scalar};
use etmetal_graph::plan::plan_memory;
use etmetal_graph::portable::to_portable;
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::{ops_to_not_decompose, partition, PartitionOptions, Step};
use etmetal_metal::payload::{Location, Payload};
use etmetal_metal::preprocess::{preprocess, PreprocessOptions, Preprocessed};
use etmetal_pte::kernels::{encode, kernel_outputs, CallArg, TensorMeta};
use etmetal_pte::{
    AllocationDetails, BackendDelegate, BackendDelegateDataReference, Chain, ContainerMetadata,
    DataLocation, DelegateCall, EValue, ExecutionPlan, ExtraTensorInfo, Instruction, KernelCall,
    Operator, Program, Segment, SubsegmentOffsets, Tensor as PteTensor,
};

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
    for (k, (name, graph)) in methods.iter().enumerate() {
        if name.is_empty() || methods[..k].iter().any(|(n, _)| n == name) {
            return Err(Error::invalid_input(format!(
                "method name `{name}` is empty or given twice"
            )));
        }
        let (l, r) = lower(name, graph, options, &lowered, progress)
            .map_err(|e| e.context(format!("method `{name}`")))?;
        lowered.push(l);
        reports.push(r);
    }
    Ok(Compiled {
        pte: write_program(&lowered)?,
        methods: reports,
    })
}

/// One method ready to serialize: portable ops and delegate calls.
struct Lowered {
    name: String,
    graph: Graph,
    delegates: Vec<DelegateData>,
    /// Mutable buffers a delegate keeps on the GPU (no `copy_` write-back).
    resident: Vec<ValueId>,
}

/// Lower one method; `earlier` are the methods lowered before it, whose
/// named data this one's weights share or step aside from.
fn lower(
    name: &str,
    graph: &Graph,
    options: &CompileOptions,
    earlier: &[Lowered],
    progress: &mut dyn FnMut(&str),
) -> Result<(Lowered, MethodReport)> {
    let mut g = graph.clone();
    check_signature(&g)?;
    let mut delegates = vec![];
    let mut reports = vec![];
    let mut cpu_nodes = vec![];
    let mut resident = vec![];
    let mut resident_state = vec![];
    if options.backend == Backend::Metal {
        etmetal_graph::decompose(&mut g, &ops_to_not_decompose);
        etmetal_graph::eliminate_dead_code(&mut g);
        let mut parts = partition(&g, &options.partition)?;
        for (i, reason) in &parts.cpu_nodes {
            let node = &g.nodes[*i];
            cpu_nodes.push((
                node.name.clone(),
                node.op.name().to_string(),
                reason.clone(),
            ));
        }
        let kept = resident_buffers(&g, &parts)?;
        for (id, p) in parts.partitions.iter_mut().enumerate() {
            let mut pre = preprocess(&g, p, &options.preprocess)
                .map_err(|e| e.context(format!("partition {} of the Metal backend", p.tag())))?;
            for &(part, buffer, new) in &kept {
                if part != id {
                    continue;
                }
                let fqn = buffer_fqn(&g, buffer)?;
                let input = p.inputs.iter().position(|&v| v == buffer);
                let output = p.outputs.iter().position(|&v| v == new);
                let (Some(input), Some(output)) = (input, output) else {
                    return Err(Error::internal(format!(
                        "state `{fqn}` is not an input and output of partition {}",
                        p.tag()
                    )));
                };
                pre.payload.keep_resident(&fqn, input, output)?;
                p.outputs.remove(output);
                g.outputs.retain(|(v, _)| *v != new);
                resident.push(buffer);
                resident_state.push(fqn);
            }
            rename_clashing_weights(&mut pre, name, earlier);
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
            delegates.push(DelegateData {
                payload,
                named_data: pre.named_data,
            });
        }
        g = with_delegate_calls(&g, &parts.partitions, &parts.steps);
    }
    etmetal_graph::decompose(&mut g, &|_| false);
    etmetal_graph::fold_conv_affine(&mut g)?;
    to_portable(&mut g)?;
    etmetal_graph::eliminate_dead_code(&mut g);
    Ok((
        Lowered {
            name: name.to_string(),
            graph: g,
            delegates,
            resident,
        },
        MethodReport {
            name: name.to_string(),
            partitions: reports,
            cpu_nodes,
            resident_state,
        },
    ))
}

/// `(partition, buffer, new value)` of each mutated buffer that one
/// partition reads and writes and nothing else touches: no CPU node or
/// other partition reads the buffer or its new value, neither is a user
/// output. That partition can keep it on the GPU.
fn resident_buffers(
    g: &Graph,
    parts: &etmetal_metal::partitioner::Partitioning,
) -> Result<Vec<(usize, ValueId, ValueId)>> {
    let user_outputs: Vec<ValueId> = g.user_outputs().collect();
    let mut out = vec![];
    for (buffer, new) in mutated_buffers(g)? {
        let readers: Vec<usize> = parts
            .partitions
            .iter()
            .enumerate()
            .filter(|(_, p)| p.inputs.contains(&buffer) || p.inputs.contains(&new))
            .map(|(i, _)| i)
            .collect();
        let on_cpu = parts.cpu_nodes.iter().any(|(i, _)| {
            g.nodes[*i]
                .inputs
                .iter()
                .flatten()
                .any(|&v| v == buffer || v == new)
        });
        let Some(part) = parts
            .partitions
            .iter()
            .position(|p| p.outputs.contains(&new))
        else {
            continue;
        };
        if readers == [part]
            && !on_cpu
            && !user_outputs.contains(&buffer)
            && !user_outputs.contains(&new)
        {
            out.push((part, buffer, new));
        }
    }
    Ok(out)
}

/// The fully qualified name of buffer input `v` (`layers.0.k_cache`).
fn buffer_fqn(g: &Graph, v: ValueId) -> Result<String> {
    g.inputs
        .iter()
        .find_map(|(x, k)| match k {
            InputKind::Buffer { fqn, .. } if *x == v => Some(fqn.clone()),
            _ => None,
        })
        .ok_or_else(|| {
            Error::internal(format!("value `{}` is not a buffer input", g.value(v).name))
        })
}

/// `g` with each partition replaced by one [`Op::Delegate`] node, nodes in
/// the partitioner's schedule.
fn with_delegate_calls(
    g: &Graph,
    partitions: &[etmetal_metal::partitioner::Partition],
    steps: &[Step],
) -> Graph {
    let mut out = g.clone();
    out.nodes = steps
        .iter()
        .map(|step| match *step {
            Step::Cpu(i) => g.nodes[i].clone(),
            Step::Delegate(id) => {
                let p = &partitions[id];
                Node {
                    name: format!("executorch_call_delegate_{id}"),
                    target: "executorch_call_delegate".into(),
                    op: Op::Delegate { index: id },
                    inputs: p.inputs.iter().copied().map(Some).collect(),
                    outputs: p.outputs.clone(),
                }
            }
        })
        .collect();
    out
}

/// A weight key an earlier method stores with other bytes (a lifted
/// constant of the same name but another shape, such as the positions of a
/// prefill's length) gets this method's name appended, in the payload too;
/// weights with the same key and bytes stay shared.
fn rename_clashing_weights(pre: &mut Preprocessed, method: &str, earlier: &[Lowered]) {
    let stored = |key: &str| {
        earlier
            .iter()
            .flat_map(|l| &l.delegates)
            .flat_map(|d| &d.named_data)
            .find(|(k, _)| k == key)
            .map(|(_, bytes)| bytes)
    };
    for (key, bytes) in &mut pre.named_data {
        if stored(key).is_some_and(|b| b != bytes) {
            let renamed = format!("{key}@{method}");
            for b in &mut pre.payload.buffers {
                if let Location::Weight { key: k } = &mut b.location {
                    if k == key {
                        *k = renamed.clone();
                    }
                }
            }
            *key = renamed;
        }
    }
}

/// A compiled partition as the `.pte` stores it.
struct DelegateData {
    payload: Vec<u8>,
    named_data: Vec<(String, Vec<u8>)>,
}

/// One mutable buffer of the program, shared by name between methods.
struct SharedState {
    fqn: String,
    initial: etmetal_core::Tensor,
    /// Offset in planned memory 2.
    offset: u64,
}

/// What the methods of one program share: the constant segment (a
/// constant of the same name and bytes is stored once), the mutable
/// buffers and the segments.
struct ProgramParts<'a> {
    constants: Vec<etmetal_core::Tensor>,
    /// Constant name → indices into `constants`.
    by_name: HashMap<String, Vec<usize>>,
    state: Vec<SharedState>,
    /// Borrowing the methods' delegate payloads and weights.
    segments: Vec<Segment<'a>>,
}

impl ProgramParts<'_> {
    /// `data_buffer_idx` of constant `v` of `g`.
    fn constant(&mut self, g: &Graph, v: ValueId) -> Result<u32> {
        let name = &g.value(v).name;
        let t = &g.constants[&v];
        let same = self.by_name.get(name).and_then(|ids| {
            ids.iter().copied().find(|&i| {
                self.constants[i].dtype() == t.dtype() && self.constants[i].bytes() == t.bytes()
            })
        });
        let i = match same {
            Some(i) => i,
            None => {
                self.constants.push(t.clone());
                self.by_name
                    .entry(name.clone())
                    .or_default()
                    .push(self.constants.len() - 1);
                self.constants.len() - 1
            }
        };
        Ok(i as u32 + 1)
    }

    /// Add the mutable buffers of `l` (by fully qualified name) and return
    /// value → index into `state`.
    fn add_state(&mut self, l: &Lowered) -> Result<HashMap<ValueId, usize>> {
        let g = &l.graph;
        let mut buffers: Vec<ValueId> = mutated_buffers(g)?.into_iter().map(|(b, _)| b).collect();
        buffers.extend(&l.resident);
        let mut map = HashMap::new();
        for b in buffers {
            let fqn = buffer_fqn(g, b)?;
            let initial = g.constants.get(&b).ok_or_else(|| {
                Error::invalid_input(format!("mutated buffer `{fqn}` has no initial value"))
            })?;
            let i = match self.state.iter().position(|s| s.fqn == fqn) {
                Some(i) => {
                    let s = &self.state[i];
                    if s.initial.dtype() != initial.dtype()
                        || s.initial.shape() != initial.shape()
                        || s.initial.bytes() != initial.bytes()
                    {
                        return Err(Error::invalid_input(format!(
                            "buffer `{fqn}` is {} {:?} in method `{}` but {} {:?} (or another \
                             initial value) in an earlier method: methods share buffers by name",
                            initial.dtype(),
                            initial.shape(),
                            l.name,
                            s.initial.dtype(),
                            s.initial.shape()
                        )));
                    }
                    i
                }
                None => {
                    let offset = self.state.last().map_or(Ok(0), |s| {
                        (s.offset + s.initial.nbytes() as u64)
                            .checked_next_multiple_of(etmetal_graph::plan::ALIGNMENT)
                            .ok_or_else(|| Error::limit("mutable buffers exceed u64 bytes"))
                    })?;
                    self.state.push(SharedState {
                        fqn,
                        initial: initial.clone(),
                        offset,
                    });
                    self.state.len() - 1
                }
            };
            map.insert(b, i);
        }
        Ok(map)
    }

    /// Bytes of planned memory 2 (every mutable buffer).
    fn state_bytes(&self) -> u64 {
        self.state
            .last()
            .map_or(0, |s| s.offset + s.initial.nbytes() as u64)
    }
}

/// Serialize the methods (portable ops and delegate calls) with their
/// delegates' payloads and named data.
fn write_program(methods: &[Lowered]) -> Result<Vec<u8>> {
    let mut parts = ProgramParts {
        constants: vec![],
        by_name: HashMap::new(),
        state: vec![],
        // the constant segment comes first; its bytes are known at the end
        segments: vec![Segment::new(vec![])],
    };
    let states = methods
        .iter()
        .map(|l| parts.add_state(l))
        .collect::<Result<Vec<_>>>()?;
    let mut mutable_data_segments = vec![];
    if !parts.state.is_empty() {
        let initial: Vec<&[u8]> = parts.state.iter().map(|s| s.initial.bytes()).collect();
        let (data, offsets) = etmetal_pte::constant_segment(&initial);
        mutable_data_segments.push(SubsegmentOffsets {
            segment_index: parts.segments.len() as u32,
            offsets,
        });
        parts.segments.push(Segment::new(data));
    }
    let mut named = vec![];
    let mut execution_plan = Vec::with_capacity(methods.len());
    for (l, state) in methods.iter().zip(&states) {
        let plan = write_plan(l, state, &mut parts, &mut named)
            .map_err(|e| e.context(format!("method `{}`", l.name)))?;
        execution_plan.push(plan);
    }
    let buffers: Vec<&[u8]> = parts.constants.iter().map(|t| t.bytes()).collect();
    let (data, offsets) = etmetal_pte::constant_segment(&buffers);
    parts.segments[0] = Segment::new(data);
    let mut program = Program {
        version: 0,
        execution_plan,
        constant_segment: Some(SubsegmentOffsets {
            segment_index: 0,
            offsets,
        }),
        mutable_data_segments,
        ..Program::default()
    };
    let mut segments = parts.segments;
    for (key, bytes) in named {
        // a weight read by several partitions (or methods) is stored once
        match program.named_data.iter().position(|n| n.key == key) {
            None => {
                etmetal_pte::add_named_data(
                    &mut program,
                    &mut segments,
                    &key,
                    bytes,
                    WEIGHT_ALIGNMENT,
                )?;
            }
            Some(i) => {
                let seg = &segments[program.named_data[i].segment_index as usize];
                if seg.data.as_ref() != bytes {
                    return Err(Error::invalid_input(format!(
                        "weight `{key}` differs between partitions or methods"
                    )));
                }
            }
        }
    }
    etmetal_pte::serialize(&program, &segments)
}

/// The execution plan of one method; its delegate payloads go to
/// `parts.segments`, their weights to `named`.
fn write_plan<'a>(
    l: &'a Lowered,
    state: &HashMap<ValueId, usize>,
    parts: &mut ProgramParts<'a>,
    named: &mut Vec<(String, &'a [u8])>,
) -> Result<ExecutionPlan> {
    let g = &l.graph;
    let mutated = mutated_buffers(g)?;
    // Kernels that write more than the op (norm statistics, pool indices)
    // get scratch tensors, planned like any value but dead after the call.
    let mut g = g.clone();
    let mut kernel_outs: Vec<Vec<ValueId>> = Vec::with_capacity(g.nodes.len());
    let mut scratch = Vec::new();
    for i in 0..g.nodes.len() {
        let node = &g.nodes[i];
        let mut outs = node.outputs.clone();
        let extra = scratch_metas(&g, i)?;
        let name = node.name.clone();
        for (k, (dtype, shape)) in extra.into_iter().enumerate() {
            let v = g.add_value(format!("{name}.scratch{k}"), dtype, shape);
            scratch.push((i, v));
            outs.push(v);
        }
        kernel_outs.push(outs);
    }
    // mutable buffers keep their initial value in `constants`, so this
    // plans memory 1 without them; they live in memory 2
    let plan = plan_memory(&g, &scratch)?;

    let mut b = PlanBuilder {
        graph: &g,
        plan: &plan,
        state,
        parts,
        values: vec![],
        ids: HashMap::new(),
    };
    let inputs: Vec<i32> = g
        .user_inputs()
        .map(|v| b.tensor(v))
        .collect::<Result<_>>()?;
    let mut operators: Vec<Operator> = vec![];
    let mut instructions = Vec::with_capacity(g.nodes.len());
    for (node, outs) in g.nodes.iter().zip(&kernel_outs) {
        let at = |e: Error| {
            e.context(format!(
                "node `{}` ({}, {})",
                node.name,
                node.op.name(),
                node.target
            ))
        };
        if let Op::Delegate { index } = node.op {
            let mut args = Vec::with_capacity(node.inputs.len() + outs.len());
            for i in 0..node.inputs.len() {
                args.push(b.slot(&node.inputs, i).map_err(at)?);
            }
            for i in 0..outs.len() {
                args.push(b.out(outs, i).map_err(at)?);
            }
            instructions.push(Instruction::DelegateCall(DelegateCall {
                delegate_index: index as i32,
                args,
            }));
            continue;
        }
        let meta = |v: ValueId| -> TensorMeta { (g.value(v).dtype, g.value(v).shape.clone()) };
        let in_metas: Vec<Option<TensorMeta>> = node.inputs.iter().map(|s| s.map(meta)).collect();
        let out_metas: Vec<TensorMeta> = outs.iter().map(|v| meta(*v)).collect();
        let call = encode(&node.op, &in_metas, &out_metas).map_err(at)?;
        let op = Operator {
            name: call.name,
            overload: call.overload,
        };
        let op_index = match operators.iter().position(|o| *o == op) {
            Some(i) => i,
            None => {
                operators.push(op);
                operators.len() - 1
            }
        };
        let args = call
            .args
            .iter()
            .map(|a| b.arg(a, &node.inputs, outs))
            .collect::<Result<Vec<i32>>>()
            .map_err(at)?;
        instructions.push(Instruction::KernelCall(KernelCall {
            op_index: op_index as i32,
            args,
        }));
    }
    for &(buffer, new) in &mutated {
        let op = Operator {
            name: "aten::copy_".into(),
            overload: String::new(),
        };
        let op_index = match operators.iter().position(|o| *o == op) {
            Some(i) => i,
            None => {
                operators.push(op);
                operators.len() - 1
            }
        };
        let (dst, src) = (b.tensor(buffer)?, b.tensor(new)?);
        let non_blocking = b.push(EValue::Bool(false));
        instructions.push(Instruction::KernelCall(KernelCall {
            op_index: op_index as i32,
            args: vec![dst, src, non_blocking, dst],
        }));
    }
    let outputs: Vec<i32> = g
        .user_outputs()
        .map(|v| b.tensor(v))
        .collect::<Result<_>>()?;

    let arena = i64::try_from(plan.size).map_err(|_| Error::limit("arena over i64 bytes"))?;
    let mut non_const_buffer_sizes = vec![0, arena];
    if !state.is_empty() {
        let bytes = b.parts.state_bytes();
        non_const_buffer_sizes
            .push(i64::try_from(bytes).map_err(|_| Error::limit("state over i64 bytes"))?);
    }
    let mut backend_delegates = vec![];
    for DelegateData {
        payload,
        named_data,
    } in &l.delegates
    {
        let segments = &mut b.parts.segments;
        backend_delegates.push(BackendDelegate {
            id: etmetal_metal::BACKEND_ID.into(),
            processed: BackendDelegateDataReference {
                location: DataLocation::Segment,
                index: segments.len() as u32,
            },
            compile_specs: vec![etmetal_metal::compile_spec::method_name_spec(&l.name)],
        });
        segments.push(Segment::new(payload.as_slice()));
        named.extend(named_data.iter().map(|(k, v)| (k.clone(), v.as_slice())));
    }
    Ok(ExecutionPlan {
        name: l.name.clone(),
        container_meta_type: Some(container_meta(inputs.len(), outputs.len())),
        values: b.values,
        inputs: inputs.clone(),
        outputs: outputs.clone(),
        chains: vec![Chain {
            inputs,
            outputs,
            instructions,
            stacktrace: None,
        }],
        operators,
        delegates: backend_delegates,
        non_const_buffer_sizes,
        non_const_buffer_device: None,
    })
}

/// Named data (GPU weights) is page-aligned in the file (Apple's 16 KiB
/// pages) so a runtime can map it without copying.
const WEIGHT_ALIGNMENT: u64 = 16 << 10;

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
    mutated_buffers(g)?;
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

/// `(buffer, new value)` of each buffer mutation of `g`'s signature.
///
/// ExecuTorch's encoding, which the `.pte` follows (checked against EXIR
/// 1.5.1 `to_executorch()` with `InitializedMutableBufferPass`): the buffer
/// is a planned tensor (`allocation_info`, alive for the whole method, so
/// its bytes persist across executes) that also names its initial value
/// (`data_buffer_idx > 0`: an offset of `mutable_data_segments[0]`, a
/// segment of its own laid out like the constant segment, copied into the
/// arena at method load), and the chain ends with one `aten::copy_` (overload "",
/// args `self, src, non_blocking, out=self`) per buffer writing the new
/// value back. Without that pass EXIR leaves `data_buffer_idx` 0 (initial
/// state meaningless); etmetal always keeps the initial value.
fn mutated_buffers(g: &Graph) -> Result<Vec<(ValueId, ValueId)>> {
    let mut out = vec![];
    for (new, kind) in &g.outputs {
        let OutputKind::BufferMutation { fqn } = kind else {
            continue;
        };
        let buffer = g
            .inputs
            .iter()
            .find_map(|(v, k)| match k {
                InputKind::Buffer { fqn: f, .. } if f == fqn => Some(*v),
                _ => None,
            })
            .ok_or_else(|| {
                Error::invalid_input(format!("buffer `{fqn}` is mutated but not an input"))
            })?;
        if !g.constants.contains_key(&buffer) {
            return Err(Error::invalid_input(format!(
                "mutated buffer `{fqn}` has no initial value"
            )));
        }
        let (b, n) = (g.value(buffer), g.value(*new));
        if (b.dtype, &b.shape) != (n.dtype, &n.shape) {
            return Err(Error::shape(format!(
                "buffer `{fqn}` is {} {:?}, its new value {} {:?}",
                b.dtype, b.shape, n.dtype, n.shape
            )));
        }
        out.push((buffer, *new));
    }
    Ok(out)
}

/// Dtype and shape of the tensors node `i`'s kernel writes beyond the node's outputs.
fn scratch_metas(g: &Graph, i: usize) -> Result<Vec<TensorMeta>> {
    let node = &g.nodes[i];
    let extra = kernel_outputs(&node.op).saturating_sub(node.outputs.len());
    if extra == 0 {
        return Ok(vec![]);
    }
    let x = node
        .inputs
        .first()
        .copied()
        .flatten()
        .map(|v| g.value(v))
        .ok_or_else(|| Error::invalid_input(format!("node `{}`: input 0 is missing", node.name)))?;
    let stats: TensorMeta = match &node.op {
        Op::LayerNorm {
            normalized_dims, ..
        } => {
            let lead = x.shape.len().saturating_sub(*normalized_dims);
            let shape = x.shape[..lead]
                .iter()
                .copied()
                .chain(std::iter::repeat_n(1, x.shape.len() - lead))
                .collect();
            (x.dtype, shape)
        }
        Op::GroupNorm { groups, .. } => (
            x.dtype,
            vec![x.shape.first().copied().unwrap_or(1), *groups],
        ),
        // inference batch norm writes no statistics: ExecuTorch sizes them 0
        Op::BatchNorm { .. } => (x.dtype, vec![0]),
        Op::MaxPool(_) => {
            let out = g.value(node.outputs[0]);
            (DType::I64, out.shape.clone())
        }
        other => {
            return Err(Error::internal(format!(
                "no scratch rule for {}",
                other.name()
            )))
        }
    };
    Ok(vec![stats; extra])
}

/// The values table of the plan, built as the kernel calls need entries.
struct PlanBuilder<'a, 'p> {
    graph: &'a Graph,
    plan: &'a etmetal_graph::plan::MemoryPlan,
    /// Mutable buffers → index into `parts.state` (and the mutable segment).
    state: &'a HashMap<ValueId, usize>,
    parts: &'a mut ProgramParts<'p>,
    values: Vec<EValue>,
    ids: HashMap<ValueId, i32>,
}

impl PlanBuilder<'_, '_> {
    fn push(&mut self, v: EValue) -> i32 {
        self.values.push(v);
        self.values.len() as i32 - 1
    }

    /// The EValue of graph value `v`: a constant-segment tensor or a planned one.
    fn tensor(&mut self, v: ValueId) -> Result<i32> {
        if let Some(&i) = self.ids.get(&v) {
            return Ok(i);
        }
        let info = self
            .graph
            .values
            .get(v.0)
            .ok_or_else(|| Error::internal(format!("value id {}", v.0)))?;
        let sizes = info
            .shape
            .iter()
            .map(|&d| i32::try_from(d))
            .collect::<std::result::Result<Vec<i32>, _>>()
            .map_err(|_| {
                Error::limit(format!(
                    "value `{}`: a dim of {:?} over i32",
                    info.name, info.shape
                ))
            })?;
        let at = |memory_id: u32, offset: u64| AllocationDetails {
            memory_id,
            memory_offset_low: offset as u32,
            memory_offset_high: (offset >> 32) as u32,
        };
        let t = if let Some(&i) = self.state.get(&v) {
            let s = &self.parts.state[i];
            let mut t =
                PteTensor::contiguous(info.dtype, sizes, i as u32 + 1, Some(at(2, s.offset)));
            t.extra_tensor_info = Some(ExtraTensorInfo {
                fully_qualified_name: s.fqn.clone(),
                ..ExtraTensorInfo::default()
            });
            t
        } else if self.graph.constants.contains_key(&v) {
            let idx = self.parts.constant(self.graph, v)?;
            PteTensor::contiguous(info.dtype, sizes, idx, None)
        } else {
            let offset = *self.plan.offsets.get(&v).ok_or_else(|| {
                Error::internal(format!("value `{}` has no planned memory", info.name))
            })?;
            PteTensor::contiguous(info.dtype, sizes, 0, Some(at(1, offset)))
        };
        let i = self.push(EValue::Tensor(t));
        self.ids.insert(v, i);
        Ok(i)
    }

    fn slot(&mut self, inputs: &[Option<ValueId>], i: usize) -> Result<i32> {
        let v = inputs
            .get(i)
            .copied()
            .flatten()
            .ok_or_else(|| Error::invalid_input(format!("input {i} is missing")))?;
        self.tensor(v)
    }

    fn out(&mut self, outs: &[ValueId], i: usize) -> Result<i32> {
        let v = *outs
            .get(i)
            .ok_or_else(|| Error::internal(format!("kernel output {i} is missing")))?;
        self.tensor(v)
    }

    /// The EValue index of one kernel argument (scalars get fresh entries,
    /// `int[]` is boxed as EXIR does: a list of `Int` value indices).
    fn arg(&mut self, a: &CallArg, inputs: &[Option<ValueId>], outs: &[ValueId]) -> Result<i32> {
        Ok(match a {
            CallArg::Input(i) => self.slot(inputs, *i)?,
            CallArg::Output(i) => self.out(outs, *i)?,
            CallArg::InputList(items) => {
                let items = items
                    .iter()
                    .map(|i| self.slot(inputs, *i))
                    .collect::<Result<_>>()?;
                self.push(EValue::TensorList(items))
            }
            CallArg::OptionalInputList(items) => {
                let items = items
                    .iter()
                    .map(|i| i.map_or(Ok(-1), |i| self.slot(inputs, i)))
                    .collect::<Result<_>>()?;
                self.push(EValue::OptionalTensorList(items))
            }
            CallArg::OutputList(items) => {
                let items = items
                    .iter()
                    .map(|i| self.out(outs, *i))
                    .collect::<Result<_>>()?;
                self.push(EValue::TensorList(items))
            }
            CallArg::NoTensor | CallArg::Null => self.push(EValue::Null),
            CallArg::Int(v) => self.push(EValue::Int(*v)),
            CallArg::Ints(items) => {
                let items = items
                    .iter()
                    .map(|v| self.push(EValue::Int(*v)) as i64)
                    .collect();
                self.push(EValue::IntList(items))
            }
            CallArg::Float(v) => self.push(EValue::Double(*v)),
            CallArg::Floats(v) => self.push(EValue::DoubleList(v.clone())),
            CallArg::Bool(v) => self.push(EValue::Bool(*v)),
            CallArg::Bools(v) => self.push(EValue::BoolList(v.clone())),
            CallArg::Str(s) => self.push(EValue::String(s.clone())),
            CallArg::Scalar(Scalar::Int(v)) => self.push(EValue::Int(*v)),
            CallArg::Scalar(Scalar::Float(v)) => self.push(EValue::Double(*v)),
            CallArg::Scalar(Scalar::Bool(v)) => self.push(EValue::Bool(*v)),
            CallArg::ScalarType(d) => self.push(EValue::Int(i64::from(d.executorch_code()))),
        })
    }
}

/// The pytree specs `to_executorch()` writes with the pip package (torch's
/// JSON `treespec_dumps`): inputs `((x0, …), {})`, outputs a tuple.
fn container_meta(n_in: usize, n_out: usize) -> ContainerMetadata {
    let leaves =
        |n: usize| vec![r#"{"type": null, "context": null, "children_spec": []}"#; n].join(", ");
    let tuple = |children: String| {
        format!(r#"{{"type": "builtins.tuple", "context": "null", "children_spec": [{children}]}}"#)
    };
    let args = tuple(leaves(n_in));
    let kwargs = r#"{"type": "builtins.dict", "context": "[]", "children_spec": []}"#;
    ContainerMetadata {
        encoded_inp_str: format!("[1, {}]", tuple(format!("{args}, {kwargs}"))),
        encoded_out_str: format!("[1, {}]", tuple(leaves(n_out))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
    }

    #[test]
    fn container_meta_matches_to_executorch() {
        // the strings EXIR 1.5.1 (pip) wrote for a module of two inputs and two outputs
        let m = container_meta(2, 2);
        let leaf = r#"{"type": null, "context": null, "children_spec": []}"#;
        assert_eq!(
            m.encoded_inp_str,
            format!(
                r#"[1, {{"type": "builtins.tuple", "context": "null", "children_spec": [{{"type": "builtins.tuple", "context": "null", "children_spec": [{leaf}, {leaf}]}}, {{"type": "builtins.dict", "context": "[]", "children_spec": []}}]}}]"#
            )
        );
        assert_eq!(
            m.encoded_out_str,
            format!(
                r#"[1, {{"type": "builtins.tuple", "context": "null", "children_spec": [{leaf}, {leaf}]}}]"#
            )
        );
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
