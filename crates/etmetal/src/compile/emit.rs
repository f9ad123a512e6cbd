//! The emitter: lowered methods (portable ops and delegate calls) → the
//! bytes of one ExecuTorch `.pte`, as ExecuTorch's `exir/emit` builds a
//! `Program` and `exir/_serialize` writes it.
//!
//! Each method becomes one execution plan with one chain of `KernelCall`s
//! (from `etmetal_pte::kernels::encode`) and `DelegateCall`s over a values
//! table ([`PlanBuilder`]); memory planning puts every intermediate in one
//! arena (`mem_id` 1). Constants are stored once in the constant segment
//! (same name and bytes), delegate payloads in segments of their own, and
//! the delegates' weights (a [`NamedDataStore`]) as page-aligned named
//! data.
//!
//! Mutable buffers are laid out as ExecuTorch's `share_mutable_buffers=True`
//! does: planned memory `mem_id` 2, one range per fully qualified name at
//! the same offset in every method, the name in `extra_tensor_info`, the
//! initial value stored once (`mutable_data_segments[0]`). ExecuTorch's
//! encoding, which the `.pte` follows (checked against EXIR 1.5.1
//! `to_executorch()` with `InitializedMutableBufferPass`): the buffer is a
//! planned tensor (`allocation_info`, alive for the whole method, so its
//! bytes persist across executes) that also names its initial value
//! (`data_buffer_idx > 0`: an offset of `mutable_data_segments[0]`, a
//! segment of its own laid out like the constant segment, copied into the
//! arena at method load), and the chain ends with one `aten::copy_`
//! (overload "", args `self, src, non_blocking, out=self`) per buffer
//! writing the new value back. Without that pass EXIR leaves
//! `data_buffer_idx` 0 (initial state meaningless); etmetal always keeps
//! the initial value. A buffer a delegate keeps on the GPU has no `copy_`.
//!
//! Bounded dynamic shapes are encoded as EXIR 1.5.1's `to_executorch()`
//! encodes them: a tensor whose shape depends on a symbol is
//! `DYNAMIC_BOUND` with its upper-bound sizes (memory is planned at the
//! bound, and the portable kernels resize their outputs); a symbolic size
//! an argument needs is an `Int` value written at run time by
//! `aten::sym_size.int` on a user input and `executorch_prim::*.Scalar`
//! arithmetic, computed once, before the first call that reads it; `int[]`
//! arguments name those values (see [`SymArg`]).

use std::collections::{HashMap, HashSet};
use std::ops::{Add, Mul, Sub};
use std::path::Path;

use etmetal_core::{DType, Error, Op, Result, Scalar, SymExpr};
use etmetal_graph::plan::plan_memory;
use etmetal_graph::{Graph, InputKind, ValueId};
use etmetal_pte::kernels::{encode, kernel_outputs, CallArg, TensorMeta};
use etmetal_pte::{
    AllocationDetails, BackendDelegate, BackendDelegateDataReference, Chain, ContainerMetadata,
    DataLocation, DelegateCall, EValue, ExecutionPlan, ExtraTensorInfo, Instruction, KernelCall,
    NamedDataStore, Operator, Program, Segment, SubsegmentOffsets, Tensor as PteTensor,
    TensorShapeDynamism,
};

/// One method ready to emit: portable ops and delegate calls.
pub(crate) struct LoweredMethod {
    pub name: String,
    pub graph: Graph,
    /// The encoded payload of each delegate, by [`Op::Delegate`] index.
    pub payloads: Vec<Vec<u8>>,
    /// Mutable buffers a delegate keeps on the GPU (no `copy_` write-back).
    pub resident: Vec<ValueId>,
    /// Mutable buffers (by name) whose value before the call the method
    /// never reads: it writes them whole first (transformers' recipe
    /// `copy_`s the position into its `cumulative_length` at every call).
    pub unread_state: HashSet<String>,
}

/// Named data (GPU weights) is page-aligned in the file (Apple's 16 KiB
/// pages) so a runtime can map it without copying.
const WEIGHT_ALIGNMENT: u64 = 16 << 10;

/// The fully qualified name of buffer input `v` (`layers.0.k_cache`).
pub(crate) fn buffer_fqn(g: &Graph, v: ValueId) -> Result<String> {
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

/// One mutable buffer of the program, shared by name between methods.
struct SharedState {
    fqn: String,
    initial: etmetal_core::Tensor,
    /// Offset in planned memory 2.
    offset: u64,
    /// The method whose initial value it keeps: the first that reads it,
    /// else the first that holds it.
    method: String,
    /// Whether a method reads its value before writing it: only then does
    /// the initial value matter.
    observed: bool,
}

/// How a buffer's initial value `b` in method `mb` differs from `a` in
/// method `ma`: "is float32 [1, 4, 8] in method `prefill` but float32 [1,
/// 4, 16] in method `forward`", or where its values differ; `None` when
/// alike.
fn state_mismatch(
    a: &etmetal_core::Tensor,
    ma: &str,
    b: &etmetal_core::Tensor,
    mb: &str,
) -> Option<String> {
    if a.dtype() != b.dtype() || a.shape() != b.shape() {
        return Some(format!(
            "is {} {:?} in method `{mb}` but {} {:?} in method `{ma}`",
            b.dtype(),
            b.shape(),
            a.dtype(),
            a.shape()
        ));
    }
    if a.bytes() == b.bytes() {
        return None;
    }
    let (va, vb) = (a.to_f64_vec(), b.to_f64_vec());
    let at = va
        .iter()
        .zip(&vb)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    let detail = at.map_or(String::new(), |k| {
        format!(" (element {k}: {} in `{mb}`, {} in `{ma}`)", vb[k], va[k])
    });
    Some(format!(
        "starts from other values in method `{mb}` than in method `{ma}`{detail}"
    ))
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
    /// value → index into `state`. `written`: the buffers any method of
    /// the program writes; one that `l` only reads is state there too, so
    /// that it reads what another method wrote, not the initial value.
    fn add_state(
        &mut self,
        l: &LoweredMethod,
        written: &HashSet<String>,
    ) -> Result<HashMap<ValueId, usize>> {
        let g = &l.graph;
        let mut buffers: Vec<ValueId> = g.buffer_mutations()?.into_iter().map(|(b, _)| b).collect();
        buffers.extend(&l.resident);
        for (v, kind) in &g.inputs {
            if let InputKind::Buffer { fqn, .. } = kind {
                if written.contains(fqn) && !buffers.contains(v) && g.constants.contains_key(v) {
                    buffers.push(*v);
                }
            }
        }
        let mut map = HashMap::new();
        for b in buffers {
            let fqn = buffer_fqn(g, b)?;
            let initial = g.constants.get(&b).ok_or_else(|| {
                Error::invalid_input(format!("mutated buffer `{fqn}` has no initial value"))
            })?;
            let reads = !l.unread_state.contains(&fqn);
            let i = match self.state.iter().position(|s| s.fqn == fqn) {
                Some(i) => {
                    let s = &mut self.state[i];
                    // an initial value no method reads is never seen: a
                    // non-strict export leaves in a buffer what tracing's
                    // real in-place ops made of it (the recipe's
                    // `cumulative_length.add_(T)`), T differing by method
                    let layout = s.initial.dtype() != initial.dtype()
                        || s.initial.shape() != initial.shape();
                    let why = state_mismatch(&s.initial, &s.method, initial, &l.name)
                        .filter(|_| layout || (reads && s.observed));
                    if let Some(why) = why {
                        return Err(Error::invalid_input(format!(
                            "state buffer `{fqn}` {why}: methods share a buffer by name, so \
                             they must hold it alike (export every method from one model with \
                             one cache: the same batch size, cache length and config)"
                        )));
                    }
                    if reads && !s.observed {
                        s.initial = initial.clone();
                        s.method = l.name.clone();
                        s.observed = true;
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
                        method: l.name.clone(),
                        observed: reads,
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
/// delegates' payloads and `named_data` (their weights).
pub(crate) fn write_program(
    methods: &[LoweredMethod],
    named_data: &NamedDataStore,
) -> Result<Vec<u8>> {
    let (program, segments) = program_and_segments(methods, named_data)?;
    etmetal_pte::serialize(&program, &segments)
}

/// [`write_program`] into a file at `path`, a piece at a time (never whole
/// in memory): the same bytes. Returns their number.
pub(crate) fn write_program_file(
    methods: &[LoweredMethod],
    named_data: &NamedDataStore,
    path: &Path,
) -> Result<u64> {
    let (program, segments) = program_and_segments(methods, named_data)?;
    etmetal_pte::serialize_to_file(&program, &segments, path)
}

/// The program of the methods and the bytes of its segments (constants,
/// mutable state, payloads, `named_data`), borrowed where they can be.
fn program_and_segments<'a>(
    methods: &'a [LoweredMethod],
    named_data: &'a NamedDataStore,
) -> Result<(Program, Vec<Segment<'a>>)> {
    let mut parts = ProgramParts {
        constants: vec![],
        by_name: HashMap::new(),
        state: vec![],
        // the constant segment comes first; its bytes are known at the end
        segments: vec![Segment::new(vec![])],
    };
    let mut written = HashSet::new();
    for l in methods {
        let mutated = l.graph.buffer_mutations()?.into_iter().map(|(b, _)| b);
        for b in mutated.chain(l.resident.iter().copied()) {
            written.insert(buffer_fqn(&l.graph, b)?);
        }
    }
    let states = methods
        .iter()
        .map(|l| parts.add_state(l, &written))
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
    let mut execution_plan = Vec::with_capacity(methods.len());
    for (l, state) in methods.iter().zip(&states) {
        let plan = write_plan(l, state, &mut parts)
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
    // after every payload: weights read by several partitions (or methods) once
    named_data.write_into(&mut program, &mut segments, WEIGHT_ALIGNMENT)?;
    Ok((program, segments))
}

/// The execution plan of one method; its delegate payloads go to
/// `parts.segments`.
fn write_plan<'a>(
    l: &'a LoweredMethod,
    state: &HashMap<ValueId, usize>,
    parts: &mut ProgramParts<'a>,
) -> Result<ExecutionPlan> {
    let g = &l.graph;
    let mutated = g.buffer_mutations()?;
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
        for (k, ((dtype, shape), dims)) in extra.into_iter().enumerate() {
            let v = g.add_value(format!("{name}.scratch{k}"), dtype, shape);
            if let Some(dims) = dims {
                g.set_sym_dims(v, dims)?;
            }
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
        sym_ids: HashMap::new(),
    };
    let inputs: Vec<i32> = g
        .user_inputs()
        .map(|v| b.tensor(v))
        .collect::<Result<_>>()?;
    let mut calls = Calls {
        operators: vec![],
        instructions: Vec::with_capacity(g.nodes.len()),
    };
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
            calls
                .instructions
                .push(Instruction::DelegateCall(DelegateCall {
                    delegate_index: index as i32,
                    args,
                }));
            continue;
        }
        let meta = |v: ValueId| -> TensorMeta { (g.value(v).dtype, g.value(v).shape.clone()) };
        let in_metas: Vec<Option<TensorMeta>> = node.inputs.iter().map(|s| s.map(meta)).collect();
        let out_metas: Vec<TensorMeta> = outs.iter().map(|v| meta(*v)).collect();
        let call = encode(&node.op, &in_metas, &out_metas).map_err(at)?;
        let op_index = calls.operator(call.name, call.overload);
        let dynamic = node
            .inputs
            .iter()
            .flatten()
            .chain(outs)
            .any(|&v| g.is_dynamic(v));
        let sym = if dynamic {
            sym_args(&g, node).map_err(at)?
        } else {
            vec![]
        };
        let mut args = Vec::with_capacity(call.args.len());
        for (k, a) in call.args.iter().enumerate() {
            let arg = match sym.iter().find(|(i, _)| *i == k) {
                Some((_, SymArg::Int(e))) => b.sym_int(e, &mut calls),
                Some((_, SymArg::Ints(es))) => es
                    .iter()
                    .map(|e| b.sym_int(e, &mut calls).map(i64::from))
                    .collect::<Result<Vec<i64>>>()
                    .map(|items| b.push(EValue::IntList(items))),
                None => b.arg(a, &node.inputs, outs),
            };
            args.push(arg.map_err(at)?);
        }
        calls
            .instructions
            .push(Instruction::KernelCall(KernelCall { op_index, args }));
    }
    for &(buffer, new) in &mutated {
        let op_index = calls.operator("aten::copy_".into(), String::new());
        let (dst, src) = (b.tensor(buffer)?, b.tensor(new)?);
        let non_blocking = b.push(EValue::Bool(false));
        calls.instructions.push(Instruction::KernelCall(KernelCall {
            op_index,
            args: vec![dst, src, non_blocking, dst],
        }));
    }
    let Calls {
        operators,
        instructions,
    } = calls;
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
    for payload in &l.payloads {
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

/// Dtype and shape of the tensors node `i`'s kernel writes beyond the
/// node's outputs, with their symbolic sizes when the node's are dynamic.
fn scratch_metas(g: &Graph, i: usize) -> Result<Vec<(TensorMeta, Option<Vec<SymExpr>>)>> {
    let node = &g.nodes[i];
    let extra = kernel_outputs(&node.op).saturating_sub(node.outputs.len());
    if extra == 0 {
        return Ok(vec![]);
    }
    let xv =
        node.inputs.first().copied().flatten().ok_or_else(|| {
            Error::invalid_input(format!("node `{}`: input 0 is missing", node.name))
        })?;
    let (x, xd) = (g.value(xv), g.sym_dims(xv));
    let one = SymExpr::Const(1);
    let (stats, dims): (TensorMeta, Vec<SymExpr>) = match &node.op {
        Op::LayerNorm {
            normalized_dims, ..
        } => {
            let lead = x.shape.len().saturating_sub(*normalized_dims);
            let shape = x.shape[..lead]
                .iter()
                .copied()
                .chain(std::iter::repeat_n(1, x.shape.len() - lead))
                .collect();
            let dims = xd[..lead]
                .iter()
                .cloned()
                .chain(std::iter::repeat_n(one, x.shape.len() - lead))
                .collect();
            ((x.dtype, shape), dims)
        }
        Op::GroupNorm { groups, .. } => (
            (
                x.dtype,
                vec![x.shape.first().copied().unwrap_or(1), *groups],
            ),
            vec![
                xd.first().cloned().unwrap_or(one),
                SymExpr::Const(*groups as i64),
            ],
        ),
        // inference batch norm writes no statistics: ExecuTorch sizes them 0
        Op::BatchNorm { .. } => ((x.dtype, vec![0]), vec![SymExpr::Const(0)]),
        Op::MaxPool(_) => {
            let out = node.outputs[0];
            ((DType::I64, g.value(out).shape.clone()), g.sym_dims(out))
        }
        other => {
            return Err(Error::internal(format!(
                "no scratch rule for {}",
                other.name()
            )))
        }
    };
    let dynamic = dims.iter().any(|d| d.as_const().is_none());
    Ok(vec![(stats, dynamic.then_some(dims)); extra])
}

/// A kernel argument that holds symbolic sizes: an `int` or an `int[]`.
enum SymArg {
    Int(SymExpr),
    Ints(Vec<SymExpr>),
}

/// The arguments of node `node`'s kernel call (indices into the encoded
/// `args`) whose ints depend on a dynamic size, as symbolic sizes: the
/// encoder writes them at the upper bound. Sizes come from the symbolic
/// shapes of the node's values (EXIR passes the program's SymInts there);
/// an int argument that cannot be recomputed from them is an error.
fn sym_args(g: &Graph, node: &etmetal_graph::Node) -> Result<Vec<(usize, SymArg)>> {
    let input = |slot: usize| {
        node.inputs
            .get(slot)
            .copied()
            .flatten()
            .ok_or_else(|| Error::invalid_input(format!("input {slot} is missing")))
    };
    let out = || {
        node.outputs
            .first()
            .map(|&v| g.sym_dims(v))
            .ok_or_else(|| Error::internal("a node without outputs"))
    };
    let c = |n: usize| SymExpr::Const(n as i64);
    Ok(match &node.op {
        // view_copy(self, size), expand_copy(self, size, implicit)
        Op::Reshape { .. } | Op::Expand { .. } => vec![(1, SymArg::Ints(out()?))],
        // full(size, fill_value)
        Op::Full { .. } => vec![(0, SymArg::Ints(out()?))],
        // slice_copy(self, dim, start, end, step) as the program wrote it
        Op::Slice { .. } if g.sym.args.contains_key(&node.outputs[0]) => {
            let a = &g.sym.args[&node.outputs[0]];
            vec![
                (2, SymArg::Int(a[0].clone())),
                (3, SymArg::Int(a[1].clone())),
            ]
        }
        // select_copy(self, dim, index)
        Op::Select { .. } if g.sym.args.contains_key(&node.outputs[0]) => {
            vec![(2, SymArg::Int(g.sym.args[&node.outputs[0]][0].clone()))]
        }
        // a slice the rewrites made: its bounds from its sizes
        Op::Slice {
            dim,
            start,
            end,
            step,
        } => {
            let x = input(0)?;
            let size = g.sym_dims(x)[*dim].clone();
            let n = out()?[*dim].clone();
            if size.as_const().is_some() && n.as_const().is_some() {
                return Ok(vec![]);
            }
            let to_end = size.as_const().is_none() && *end == g.value(x).shape[*dim];
            let (start, end) = if *step == 1 && to_end {
                // to the end of the dim: start where the `n` last begin
                (SymExpr::sub(size.clone(), n), size)
            } else {
                // a static start: end after the `n`-th element
                let span = SymExpr::add(
                    SymExpr::mul(SymExpr::sub(n, SymExpr::Const(1)), c(*step)),
                    SymExpr::Const(1),
                );
                (c(*start), SymExpr::add(c(*start), span))
            };
            vec![(2, SymArg::Int(start)), (3, SymArg::Int(end))]
        }
        // arange(start, end, step): the end after `n` steps
        Op::Arange { start, step, .. } => match (start, step) {
            (Scalar::Int(a), Scalar::Int(s)) => {
                let n = out()?[0].clone();
                let end = SymExpr::add(SymExpr::Const(*a), SymExpr::mul(n, SymExpr::Const(*s)));
                vec![(1, SymArg::Int(end))]
            }
            _ => return Err(Error::unsupported("a float arange of dynamic length")),
        },
        Op::Select { dim, .. } if g.sym_dims(input(0)?)[*dim].as_const().is_none() => {
            return Err(Error::unsupported(
                "select on a dynamic dim (its index is only known at the upper bound)",
            ))
        }
        // native_layer_norm(input, normalized_shape, …)
        Op::LayerNorm {
            normalized_dims, ..
        } => {
            let x = g.sym_dims(input(0)?);
            let lead = x.len().saturating_sub(*normalized_dims);
            vec![(1, SymArg::Ints(x[lead..].to_vec()))]
        }
        // native_group_norm(input, weight, bias, N, C, HxW, group, eps)
        Op::GroupNorm { .. } => {
            let x = g.sym_dims(input(0)?);
            let hxw = x[2..].iter().cloned().fold(SymExpr::Const(1), SymExpr::mul);
            vec![
                (3, SymArg::Int(x[0].clone())),
                (4, SymArg::Int(x[1].clone())),
                (5, SymArg::Int(hxw)),
            ]
        }
        _ => vec![],
    })
}

/// The operators and instructions of one chain, as they are added.
struct Calls {
    operators: Vec<Operator>,
    instructions: Vec<Instruction>,
}

impl Calls {
    /// The index of operator `name.overload`, added at its first use.
    fn operator(&mut self, name: String, overload: String) -> i32 {
        let op = Operator { name, overload };
        match self.operators.iter().position(|o| *o == op) {
            Some(i) => i as i32,
            None => {
                self.operators.push(op);
                self.operators.len() as i32 - 1
            }
        }
    }

    fn kernel(&mut self, name: &str, overload: &str, args: Vec<i32>) {
        let op_index = self.operator(name.into(), overload.into());
        self.instructions
            .push(Instruction::KernelCall(KernelCall { op_index, args }));
    }
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
    /// The `Int` value computed for each symbolic size.
    sym_ids: HashMap<SymExpr, i32>,
}

impl PlanBuilder<'_, '_> {
    /// The `Int` value holding symbolic size `e` at run time: a literal
    /// for a constant, else computed by kernel calls added to `calls` (the
    /// first time `e` is needed): `aten::sym_size.int` of a user input for
    /// a symbol, `executorch_prim::*.Scalar` for the arithmetic.
    fn sym_int(&mut self, e: &SymExpr, calls: &mut Calls) -> Result<i32> {
        if let Some(&i) = self.sym_ids.get(e) {
            return Ok(i);
        }
        let i = match e {
            // a literal each time, as EXIR writes them
            SymExpr::Const(v) => return Ok(self.push(EValue::Int(*v))),
            SymExpr::Sym(name) => {
                // the size `k*name + c` of a user input dim, solved for `name`
                let (v, dim, k, c) = self.sym_source(name)?;
                let size = self.graph.sym_dims(v)[dim].clone();
                let mut out = match self.sym_ids.get(&size) {
                    Some(&i) => i,
                    None => {
                        let t = self.tensor(v)?;
                        let d = self.push(EValue::Int(dim as i64));
                        let out = self.push(EValue::Int(0));
                        calls.kernel("aten::sym_size", "int", vec![t, d, out]);
                        self.sym_ids.insert(size, out);
                        out
                    }
                };
                if c != 0 {
                    let c = self.push(EValue::Int(c));
                    out = self.prim(calls, "sub", out, c);
                }
                if k != 1 {
                    let k = self.push(EValue::Int(k));
                    out = self.prim(calls, "floordiv", out, k);
                }
                out
            }
            SymExpr::Add(terms) => {
                let mut acc = self.sym_int(&terms[0], calls)?;
                for t in &terms[1..] {
                    // `a + -k*x` as `a - k*x`, as Python writes it
                    let negative = match t {
                        SymExpr::Const(v) => *v < 0,
                        SymExpr::Mul(fs) => fs[0].as_const().is_some_and(|k| k < 0),
                        _ => false,
                    };
                    acc = if negative {
                        let y =
                            self.sym_int(&SymExpr::mul(SymExpr::Const(-1), t.clone()), calls)?;
                        self.prim(calls, "sub", acc, y)
                    } else {
                        let y = self.sym_int(t, calls)?;
                        self.prim(calls, "add", acc, y)
                    };
                }
                acc
            }
            SymExpr::Mul(factors) => {
                let mut acc = self.sym_int(&factors[0], calls)?;
                for f in &factors[1..] {
                    let y = self.sym_int(f, calls)?;
                    acc = self.prim(calls, "mul", acc, y);
                }
                acc
            }
            SymExpr::FloorDiv(a, b)
            | SymExpr::Mod(a, b)
            | SymExpr::Max(a, b)
            | SymExpr::Min(a, b) => {
                let op = match e {
                    SymExpr::FloorDiv(..) => "floordiv",
                    SymExpr::Mod(..) => "mod",
                    SymExpr::Max(..) => "sym_max",
                    _ => "sym_min",
                };
                let x = self.sym_int(a, calls)?;
                let y = self.sym_int(b, calls)?;
                self.prim(calls, op, x, y)
            }
        };
        self.sym_ids.insert(e.clone(), i);
        Ok(i)
    }

    /// `executorch_prim::{op}.Scalar(x, y)` into a new `Int` value.
    fn prim(&mut self, calls: &mut Calls, op: &str, x: i32, y: i32) -> i32 {
        let out = self.push(EValue::Int(0));
        calls.kernel(&format!("executorch_prim::{op}"), "Scalar", vec![x, y, out]);
        out
    }

    /// A user input and dim whose size is `k*name + c`, with `(k, c)`;
    /// a dim that is the symbol itself first.
    fn sym_source(&self, name: &str) -> Result<(ValueId, usize, i64, i64)> {
        let mut found = vec![];
        for v in self.graph.user_inputs() {
            for (d, e) in self
                .graph
                .sym
                .dims
                .get(&v)
                .into_iter()
                .flatten()
                .enumerate()
            {
                if let Some((k, c)) = e.affine_in(name) {
                    found.push((v, d, k, c));
                }
            }
        }
        found
            .into_iter()
            .min_by_key(|&(_, _, k, c)| (k != 1 || c != 0, k.abs()))
            .filter(|&(_, _, k, _)| k > 0)
            .ok_or_else(|| {
                Error::unsupported(format!(
                    "symbol `{name}` is not k*{name} + c for a size of a user input, so \
                     its value is unknown at run time"
                ))
            })
    }

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
        let mut t = if let Some(&i) = self.state.get(&v) {
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
        if self.graph.is_dynamic(v) {
            t.shape_dynamism = TensorShapeDynamism::DynamicBound;
        }
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
}
