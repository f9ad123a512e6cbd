//! `etmetal compile`: lower a graph to an ExecuTorch `.pte`.
//!
//! Pipeline: with the Metal backend, decompose all but the ops the backend
//! takes whole → partition → [`preprocess`] each partition into a delegate
//! payload (its weights into named data) → replace each partition by one
//! delegate-call node. Then, for what stays on the CPU: decompose everything
//! → [`to_portable`] → dead-code elimination → memory planning (one arena,
//! `mem_id` 1) → one `forward` plan with one chain of `KernelCall`s (from
//! `etmetal_pte::kernels::encode`) and `DelegateCall`s → constants stored
//! once in the constant segment → [`etmetal_pte::serialize`]. With the CPU
//! backend the file runs in ExecuTorch's own runtime.

use std::collections::HashMap;
use std::path::Path;

use etmetal_core::{DType, Error, Op, Result, Scalar};
use etmetal_graph::plan::plan_memory;
use etmetal_graph::portable::to_portable;
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::{ops_to_not_decompose, partition, PartitionOptions, Step};
use etmetal_metal::payload::Payload;
use etmetal_metal::preprocess::{preprocess, PreprocessOptions};
use etmetal_pte::kernels::{encode, kernel_outputs, CallArg, TensorMeta};
use etmetal_pte::{
    AllocationDetails, BackendDelegate, BackendDelegateDataReference, Chain, ContainerMetadata,
    DataLocation, DelegateCall, EValue, ExecutionPlan, Instruction, KernelCall, Operator, Program,
    Segment, SubsegmentOffsets, Tensor as PteTensor,
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

/// One delegated partition of a compiled program, for reports.
#[derive(Clone, Debug)]
pub struct PartitionReport {
    /// `tag0`, `tag1`, … as ExecuTorch tags delegated nodes.
    pub tag: String,
    /// The delegated nodes' names.
    pub nodes: Vec<String>,
    pub payload: Payload,
    pub payload_bytes: usize,
}

/// A compiled program and what went where.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub pte: Vec<u8>,
    pub partitions: Vec<PartitionReport>,
    /// Nodes left on the CPU: `(node, op, reason)`.
    pub cpu_nodes: Vec<(String, String, String)>,
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

/// Compile `graph`; `progress` hears one line per partition compiled.
pub fn compile(
    graph: &Graph,
    options: &CompileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Compiled> {
    let mut g = graph.clone();
    check_signature(&g)?;
    let mut delegates = vec![];
    let mut reports = vec![];
    let mut cpu_nodes = vec![];
    if options.backend == Backend::Metal {
        etmetal_graph::decompose(&mut g, &ops_to_not_decompose);
        etmetal_graph::eliminate_dead_code(&mut g);
        let parts = partition(&g, &options.partition)?;
        for (i, reason) in &parts.cpu_nodes {
            let node = &g.nodes[*i];
            cpu_nodes.push((node.name.clone(), node.op.name(), reason.clone()));
        }
        for p in &parts.partitions {
            let pre = preprocess(&g, p, &options.preprocess)
                .map_err(|e| e.context(format!("partition {} of the Metal backend", p.tag())))?;
            let payload = pre.payload.encode();
            progress(&format!(
                "partition {}: {} nodes → {} kernels, {} dispatches",
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
    to_portable(&mut g)?;
    etmetal_graph::eliminate_dead_code(&mut g);
    Ok(Compiled {
        pte: write_program(&g, delegates)?,
        partitions: reports,
        cpu_nodes,
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

/// Serialize `g` (portable ops and delegate calls) with its delegates'
/// payloads and named data.
/// A compiled partition as the `.pte` stores it.
struct DelegateData {
    payload: Vec<u8>,
    named_data: Vec<(String, Vec<u8>)>,
}

fn write_program(g: &Graph, delegates: Vec<DelegateData>) -> Result<Vec<u8>> {
    let mut g = g.clone();
    // Mutated buffers are planned, not constant, and live to the end of the
    // chain, where their new value is copied in.
    let mutated = mutated_buffers(&g)?;
    let mut initial = HashMap::new();
    for &(buffer, _) in &mutated {
        if let Some(t) = g.constants.remove(&buffer) {
            initial.insert(buffer, t);
        }
        let fqn = g.value(buffer).name.clone();
        g.outputs.push((buffer, OutputKind::BufferMutation { fqn }));
    }
    // Kernels that write more than the op (norm statistics, pool indices)
    // get scratch tensors, planned like any value but dead after the call.
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
    let plan = plan_memory(&g, &scratch)?;

    let mut b = PlanBuilder {
        graph: &g,
        plan: &plan,
        initial: &initial,
        values: vec![],
        ids: HashMap::new(),
        constants: vec![],
        mutable: vec![],
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

    let buffers: Vec<&[u8]> = b.constants.iter().map(|v| g.constants[v].bytes()).collect();
    let (data, offsets) = etmetal_pte::constant_segment(&buffers);
    let arena = i64::try_from(plan.size).map_err(|_| Error::limit("arena over i64 bytes"))?;
    let mut segments = vec![Segment::new(data)];
    let mut mutable_data_segments = vec![];
    if !b.mutable.is_empty() {
        let states: Vec<&[u8]> = b.mutable.iter().map(|v| initial[v].bytes()).collect();
        let (data, offsets) = etmetal_pte::constant_segment(&states);
        mutable_data_segments.push(SubsegmentOffsets {
            segment_index: segments.len() as u32,
            offsets,
        });
        segments.push(Segment::new(data));
    }
    let mut backend_delegates = vec![];
    let mut named = vec![];
    for DelegateData {
        payload,
        named_data,
    } in delegates
    {
        backend_delegates.push(BackendDelegate {
            id: etmetal_metal::BACKEND_ID.into(),
            processed: BackendDelegateDataReference {
                location: DataLocation::Segment,
                index: segments.len() as u32,
            },
            compile_specs: vec![etmetal_metal::compile_spec::method_name_spec("forward")],
        });
        segments.push(Segment::new(payload));
        named.extend(named_data);
    }
    let execution_plan = ExecutionPlan {
        name: "forward".into(),
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
        non_const_buffer_sizes: vec![0, arena],
        non_const_buffer_device: None,
    };
    let mut program = Program {
        version: 0,
        execution_plan: vec![execution_plan],
        constant_segment: Some(SubsegmentOffsets {
            segment_index: 0,
            offsets,
        }),
        mutable_data_segments,
        ..Program::default()
    };
    for (key, bytes) in named {
        // a weight read by several partitions is stored once
        if !program.named_data.iter().any(|n| n.key == key) {
            etmetal_pte::add_named_data(
                &mut program,
                &mut segments,
                &key,
                bytes,
                WEIGHT_ALIGNMENT,
            )?;
        }
    }
    etmetal_pte::serialize(&program, &segments)
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
        Op::MaxPool { .. } => {
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
struct PlanBuilder<'a> {
    graph: &'a Graph,
    plan: &'a etmetal_graph::plan::MemoryPlan,
    /// Initial values of mutated buffers (planned tensors with constant data).
    initial: &'a HashMap<ValueId, etmetal_core::Tensor>,
    values: Vec<EValue>,
    ids: HashMap<ValueId, i32>,
    /// Constant values in constant-segment order (`data_buffer_idx` - 1).
    constants: Vec<ValueId>,
    /// Mutated buffers in mutable-segment order (`data_buffer_idx` - 1).
    mutable: Vec<ValueId>,
}

impl PlanBuilder<'_> {
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
        let (data_buffer_idx, allocation_info) = if self.graph.constants.contains_key(&v) {
            self.constants.push(v);
            (self.constants.len() as u32, None)
        } else {
            let offset = *self.plan.offsets.get(&v).ok_or_else(|| {
                Error::internal(format!("value `{}` has no planned memory", info.name))
            })?;
            let details = AllocationDetails {
                memory_id: 1,
                memory_offset_low: offset as u32,
                memory_offset_high: (offset >> 32) as u32,
            };
            let data = if self.initial.contains_key(&v) {
                self.mutable.push(v);
                self.mutable.len() as u32
            } else {
                0
            };
            (data, Some(details))
        };
        let t = PteTensor::contiguous(info.dtype, sizes, data_buffer_idx, allocation_info);
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
