//! A loaded method: its values, and chain 0's instructions prepared once
//! (kernel calls decoded into ops, scalar operands made tensors, delegates
//! initialised), then run by [`Method::execute`].
//!
//! Mutable buffers (planned tensors with an initial value) are the method's
//! state. A delegate may keep one on its device ([`DelegateHandle::resident_args`]):
//! the method then tracks which copy is current, so the host copy is
//! written into the device only after a reset or [`Method::write_state`],
//! and read back only by [`Method::read_state`].
//!
//! Dynamic shapes (ExecuTorch's `DYNAMIC_BOUND`): inputs may be smaller
//! than their planned bound; symbolic-int calls (`sym_size`,
//! `executorch_prim::*`) compute `Int`s at run time, and every kernel call
//! that reads a dynamic tensor or such an `Int` is decoded again at each
//! execute, so its op runs at the actual sizes and its outputs take the
//! shapes it computes (within their bounds).

use std::collections::{BTreeMap, BTreeSet};

use etmetal_core::dtype::{result_type, Operand as Promoted};
use etmetal_core::{check_inputs, DType, Error, Op, Result, Scalar, Tensor, TensorSpec, View};
use etmetal_pte::kernels::{decode_call, decode_sym, DecodedCall, SymCall};
use etmetal_pte::{EValue, Instruction, Operator, PteFile};

use crate::backend::{BackendRegistry, DelegateArg, DelegateHandle};
use crate::trace;
use crate::values::{Slot, Values};

enum Operand {
    Value(usize),
    /// A scalar operand as the 0-d tensor the op set expects.
    Scalar(Tensor),
}

struct PreparedOp {
    op: Op,
    inputs: Vec<Option<Operand>>,
    outputs: Vec<usize>,
    /// Each output's dtype and planned shape (for a dynamic one, its bound).
    specs: Vec<(DType, Vec<usize>)>,
    /// Which outputs are dynamic: their shape is the one the kernel computes.
    bounded: Vec<bool>,
}

/// An instruction of the chain, ready to run (kernels looked up, delegates
/// initialised); `Method::steps` holds one per chain instruction.
enum PreparedInstruction {
    Kernel {
        name: String,
        ops: Vec<PreparedOp>,
    },
    /// A kernel call that reads dynamic shapes or run-time `Int`s, decoded
    /// at each execute.
    DynamicKernel {
        name: String,
        operator: Operator,
        args: Vec<i32>,
    },
    /// A symbolic-int call.
    Sym {
        name: String,
        call: SymCall,
    },
    Delegate {
        id: String,
        handle: Box<dyn DelegateHandle>,
        /// The call's arguments: inputs, then `outputs` outputs.
        args: Vec<usize>,
        outputs: usize,
        /// `(argument position, index into Method::states)` of the mutable
        /// buffers this delegate keeps resident.
        resident: Vec<(usize, usize)>,
    },
    Move {
        from: usize,
        to: usize,
    },
    JumpFalse {
        cond: usize,
        dest: usize,
    },
    /// Planned memory is never freed; `FreeCall` only matters for dynamic tensors.
    Free,
}

impl PreparedInstruction {
    /// What the instruction is, for the host trace.
    fn describe(&self) -> String {
        match self {
            PreparedInstruction::Kernel { name, .. } => format!("kernel {name}"),
            PreparedInstruction::DynamicKernel { name, .. } => format!("kernel {name} (dynamic)"),
            PreparedInstruction::Sym { name, .. } => format!("sym {name}"),
            PreparedInstruction::Delegate { id, .. } => format!("delegate {id}"),
            PreparedInstruction::Move { from, to } => format!("move {from} -> {to}"),
            PreparedInstruction::JumpFalse { .. } => "jump".into(),
            PreparedInstruction::Free => "free".into(),
        }
    }
}

/// One mutable buffer of the method.
struct State {
    value: usize,
    fqn: Option<String>,
    /// `(step, argument position)` of the delegate keeping it resident.
    keeper: Option<(usize, usize)>,
    /// Whether the keeper's device copy is current (the host copy is not).
    on_device: bool,
}

pub struct Method {
    name: String,
    values: Values,
    steps: Vec<PreparedInstruction>,
    states: Vec<State>,
    inputs: Vec<(usize, TensorSpec)>,
    outputs: Vec<(usize, TensorSpec)>,
}

fn as_scalar(e: &EValue) -> Option<Scalar> {
    match e {
        EValue::Int(v) => Some(Scalar::Int(*v)),
        EValue::Double(v) => Some(Scalar::Float(*v)),
        EValue::Bool(v) => Some(Scalar::Bool(*v)),
        _ => None,
    }
}

fn spec(values: &Values, v: usize) -> Result<TensorSpec> {
    Ok(values.tensor_slot(v)?.spec())
}

/// Whether a kernel call reads a dynamic tensor or a run-time scalar, in
/// its arguments or the items of its list arguments.
fn reads_dynamic(values: &Values, args: &[i32], runtime: &BTreeSet<usize>) -> bool {
    let dynamic = |v: usize| {
        runtime.contains(&v) || matches!(values.get(v), Ok(Slot::Tensor(t)) if t.dynamic)
    };
    args.iter().any(|&a| {
        let v = a as usize;
        dynamic(v)
            || match values.table().get(v) {
                Some(EValue::IntList(items)) => items.iter().any(|&i| dynamic(i as usize)),
                Some(EValue::TensorList(items) | EValue::OptionalTensorList(items)) => {
                    items.iter().any(|&i| i >= 0 && dynamic(i as usize))
                }
                _ => false,
            }
    })
}

/// Print the trace of an execute (`report`, then what the current thread
/// recorded since), if there is one.
fn print_report(report: String) {
    let report = report + &trace::take_report();
    if !report.is_empty() {
        eprint!("{report}");
    }
}

/// Check borrowed inputs against `specs` as [`check_inputs`] checks
/// tensors, with no rounding: count, dtype, shape, and bytes for the shape.
fn check_views(specs: &[TensorSpec], inputs: &[View<'_>]) -> Result<()> {
    if inputs.len() != specs.len() {
        return Err(Error::invalid_input(format!(
            "the program takes {} input(s), {} given",
            specs.len(),
            inputs.len()
        )));
    }
    for (i, (t, spec)) in inputs.iter().zip(specs).enumerate() {
        let why = spec.mismatch(t.shape);
        if t.dtype != spec.dtype || (why.is_some() && !spec.is_dynamic()) {
            return Err(Error::invalid_input(format!(
                "input {i}: expected {} {}, got {} {:?}",
                spec.dtype,
                spec.shape_text(),
                t.dtype,
                t.shape
            )));
        }
        if let Some(why) = why {
            return Err(Error::invalid_input(format!("input {i}: {why}")));
        }
        let need = etmetal_core::shape::numel(t.shape)?.checked_mul(t.dtype.size());
        if need != Some(t.bytes.len()) {
            return Err(Error::invalid_input(format!(
                "input {i}: {} bytes given for {} {:?}, which needs {}",
                t.bytes.len(),
                t.dtype,
                t.shape,
                need.map_or_else(|| "more than fits in memory".into(), |n| n.to_string())
            )));
        }
    }
    Ok(())
}

/// Run a symbolic-int call: the tensor sizes it reads are current ones.
fn run_sym(values: &mut Values, call: &SymCall) -> Result<()> {
    let scalar = |v: usize| match values.get(v)? {
        Slot::Value(e) => {
            as_scalar(e).ok_or_else(|| Error::format(format!("value {v} is {e:?}, not a scalar")))
        }
        Slot::Tensor(_) => Err(Error::format(format!(
            "value {v} is a tensor, not a scalar"
        ))),
    };
    let result = match call {
        SymCall::Size { tensor, dim, .. } => {
            let shape = &values.tensor_slot(*tensor)?.shape;
            let d = etmetal_core::shape::normalize_dim(*dim, shape.len())?;
            Scalar::Int(shape[d] as i64)
        }
        SymCall::Numel { tensor, .. } => {
            Scalar::Int(etmetal_core::shape::numel(&values.tensor_slot(*tensor)?.shape)? as i64)
        }
        SymCall::Prim { op, operands, .. } => {
            let x = operands
                .iter()
                .map(|&v| scalar(v))
                .collect::<Result<Vec<_>>>()?;
            op.eval(&x)?
        }
    };
    values.set_scalar(call.out(), result)
}

impl Method {
    pub(crate) fn load(
        file: &PteFile,
        plan: usize,
        backends: &BackendRegistry,
        max_arena_bytes: u64,
    ) -> Result<Method> {
        let p = &file.program.execution_plan[plan];
        let mut values = Values::new(file, plan, max_arena_bytes)?;
        // values that symbolic-int calls write
        let mut runtime = BTreeSet::new();
        let io = |list: &[i32], what: &str| -> Result<Vec<(usize, TensorSpec)>> {
            list.iter()
                .enumerate()
                .map(|(i, &v)| {
                    let v = v as usize;
                    spec(&values, v).map(|s| (v, s)).map_err(|_| {
                        Error::unsupported(format!("{what} {i} (value {v}) is not a tensor"))
                    })
                })
                .collect()
        };
        let inputs = io(&p.inputs, "input")?;
        let outputs = io(&p.outputs, "output")?;
        let chain = match p.chains.as_slice() {
            [chain] => chain,
            [] => return Err(Error::format("the method has no chain")),
            more => {
                return Err(Error::unsupported(format!(
                    "{} chains (only one is supported)",
                    more.len()
                )))
            }
        };
        let mut steps = Vec::with_capacity(chain.instructions.len());
        // Values a kernel leaves unwritten (norm statistics), until rewritten.
        let mut unwritten: BTreeMap<usize, String> = BTreeMap::new();
        for (k, ins) in chain.instructions.iter().enumerate() {
            let at = |e: Error| e.context(format!("instruction {k}"));
            let reads: Vec<usize>;
            let step = match ins {
                Instruction::KernelCall(c) => {
                    let operator = &p.operators[c.op_index as usize];
                    let name = operator.qualified_name();
                    if let Some(call) = decode_sym(&p.values, operator, &c.args) {
                        let call = call.map_err(at)?;
                        // at load the dynamic tensors have their bound
                        // shapes: the Ints are those of the largest inputs,
                        // which the calls decoded below see
                        run_sym(&mut values, &call).map_err(|e| {
                            at(e.context(format!("kernel {name} at the upper bounds")))
                        })?;
                        runtime.insert(call.out());
                        steps.push(PreparedInstruction::Sym { name, call });
                        continue;
                    }
                    let DecodedCall {
                        ops,
                        unwritten: left,
                    } = decode_call(values.table(), operator, &c.args).map_err(at)?;
                    let dynamic = reads_dynamic(&values, &c.args, &runtime);
                    let ops = ops
                        .into_iter()
                        .map(|d| Method::prepare(&values, d.op, &d.inputs, d.outputs))
                        .collect::<Result<Vec<_>>>()
                        .map_err(|e| at(e.context(format!("kernel {name}"))))?;
                    reads = ops
                        .iter()
                        .flat_map(|o| o.inputs.iter().flatten())
                        .filter_map(|i| match i {
                            Operand::Value(v) => Some(*v),
                            Operand::Scalar(_) => None,
                        })
                        .collect();
                    check_reads(&unwritten, &reads, k)?;
                    for o in &ops {
                        o.outputs.iter().for_each(|v| {
                            unwritten.remove(v);
                        });
                    }
                    for v in left {
                        unwritten.insert(v, name.clone());
                    }
                    if dynamic {
                        PreparedInstruction::DynamicKernel {
                            name,
                            operator: operator.clone(),
                            args: c.args.clone(),
                        }
                    } else {
                        PreparedInstruction::Kernel { name, ops }
                    }
                }
                Instruction::DelegateCall(c) => {
                    let d = &p.delegates[c.delegate_index as usize];
                    let backend = backends.require(&d.id).map_err(at)?;
                    let processed = file
                        .delegate_data(plan, c.delegate_index as usize)
                        .map_err(at)?;
                    let handle = backend
                        .init(processed, &d.compile_specs, file)
                        .map_err(|e| at(e.context(format!("initialising delegate `{}`", d.id))))?;
                    let args: Vec<usize> = c.args.iter().map(|&a| a as usize).collect();
                    check_reads(&unwritten, &args, k)?;
                    let outputs = handle.output_count();
                    if outputs > args.len() {
                        return Err(at(Error::format(format!(
                            "delegate `{}` has {outputs} outputs but the call passes {} arguments",
                            d.id,
                            args.len()
                        ))));
                    }
                    PreparedInstruction::Delegate {
                        id: d.id.clone(),
                        handle,
                        args,
                        outputs,
                        resident: vec![],
                    }
                }
                Instruction::MoveCall(m) => {
                    check_reads(&unwritten, &[m.move_from as usize], k)?;
                    PreparedInstruction::Move {
                        from: m.move_from as usize,
                        to: m.move_to as usize,
                    }
                }
                // Forward jumps only: then every execute ends (the program
                // counter only grows), and etmetal's compiler emits no loops.
                Instruction::JumpFalseCall(j) if j.destination_instruction as usize <= k => {
                    return Err(Error::unsupported(format!(
                        "instruction {k} jumps back to instruction {} (loops are not supported)",
                        j.destination_instruction
                    )))
                }
                Instruction::JumpFalseCall(j) => PreparedInstruction::JumpFalse {
                    cond: j.cond_value_index as usize,
                    dest: j.destination_instruction as usize,
                },
                Instruction::FreeCall(_) => PreparedInstruction::Free,
            };
            steps.push(step);
        }
        let outs: Vec<usize> = outputs.iter().map(|(v, _)| *v).collect();
        check_reads(&unwritten, &outs, chain.instructions.len())?;
        let mut states: Vec<State> = values
            .states()
            .map(|(value, fqn)| State {
                value,
                fqn: fqn.map(str::to_string),
                keeper: None,
                on_device: false,
            })
            .collect();
        let io: Vec<usize> = inputs.iter().chain(&outputs).map(|(v, _)| *v).collect();
        resident_state(&mut steps, &mut states, &io)?;
        Ok(Method {
            name: p.name.clone(),
            values,
            steps,
            states,
            inputs,
            outputs,
        })
    }

    fn prepare(
        values: &Values,
        op: Op,
        inputs: &[Option<usize>],
        outputs: Vec<usize>,
    ) -> Result<PreparedOp> {
        // The tensor a scalar operand pairs with: the first tensor operand,
        // skipping `where`'s condition.
        let skip = usize::from(matches!(op, Op::Where));
        let partner = inputs
            .iter()
            .skip(skip)
            .flatten()
            .find_map(|&v| values.tensor_slot(v).ok().map(|t| t.dtype));
        let inputs = inputs
            .iter()
            .map(|slot| {
                let Some(v) = *slot else { return Ok(None) };
                match values.get(v)? {
                    Slot::Tensor(_) => Ok(Some(Operand::Value(v))),
                    Slot::Value(e) => {
                        let s = as_scalar(e)
                            .ok_or_else(|| Error::format(format!("operand value {v} is {e:?}, not a tensor or scalar")))?;
                        let partner = partner.ok_or_else(|| {
                            Error::unsupported(format!("scalar operand value {v} has no tensor operand to take a dtype from"))
                        })?;
                        // PyTorch computes `partner op s` in this dtype
                        let dtype = result_type(Promoted::Tensor(partner), Promoted::Scalar(s));
                        let t = match s {
                            Scalar::Int(i) => Tensor::from_i64(dtype, &[], &[i])?,
                            _ => Tensor::scalar_f64(dtype, s.to_f64())?,
                        };
                        Ok(Some(Operand::Scalar(t)))
                    }
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let specs = outputs
            .iter()
            .map(|&v| spec(values, v).map(|s| (s.dtype, s.shape)))
            .collect::<Result<Vec<_>>>()?;
        let bounded = outputs
            .iter()
            .map(|&v| values.tensor_slot(v).map(|t| t.dynamic))
            .collect::<Result<Vec<_>>>()?;
        Ok(PreparedOp {
            op,
            inputs,
            outputs,
            specs,
            bounded,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn input_specs(&self) -> Vec<TensorSpec> {
        self.inputs.iter().map(|(_, s)| s.clone()).collect()
    }

    pub fn output_specs(&self) -> Vec<TensorSpec> {
        self.outputs.iter().map(|(_, s)| s.clone()).collect()
    }

    /// Bytes allocated for planned memory (at most what the file declares).
    pub fn arena_bytes(&self) -> usize {
        self.values.arena_bytes()
    }

    /// Put every mutable buffer (a KV cache, a step counter) back to the
    /// initial value the file stores, as a freshly loaded method has it;
    /// state otherwise carries from one [`Method::execute`] to the next.
    pub fn reset_state(&mut self) -> Result<()> {
        self.values.reset_state()?;
        self.states.iter_mut().for_each(|s| s.on_device = false);
        for step in &mut self.steps {
            if let PreparedInstruction::Delegate { id, handle, .. } = step {
                handle
                    .reset_state()
                    .map_err(|e| e.context(format!("resetting delegate `{id}`")))?;
            }
        }
        Ok(())
    }

    /// Fully qualified names of the mutable buffers (`layers.0.k_cache`) the
    /// file names, which [`Method::read_state`] and [`Method::write_state`] use.
    pub fn state_names(&self) -> Vec<&str> {
        self.states
            .iter()
            .filter_map(|s| s.fqn.as_deref())
            .collect()
    }

    /// The current value of every named mutable buffer; state a delegate
    /// keeps on its device is read back from it (and stays there).
    pub fn read_state(&mut self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(self.states.len());
        for s in &self.states {
            let Some(fqn) = &s.fqn else { continue };
            let t = match s.keeper {
                Some((step, position)) if s.on_device => {
                    let PreparedInstruction::Delegate { id, handle, .. } = &mut self.steps[step]
                    else {
                        return Err(Error::internal(format!(
                            "state `{fqn}` is kept by a non-delegate"
                        )));
                    };
                    handle.read_state(position).map_err(|e| {
                        e.context(format!("reading state `{fqn}` from delegate `{id}`"))
                    })?
                }
                _ => self.values.read(s.value)?,
            };
            out.push((fqn.clone(), t));
        }
        Ok(out)
    }

    /// Set the named mutable buffers of `state` that this method has (others
    /// are skipped), as another method of the program left them; a delegate
    /// keeping one resident takes the new value at the next execute.
    pub fn write_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        for (fqn, t) in state {
            if let Some(s) = self.states.iter_mut().find(|s| s.fqn.as_ref() == Some(fqn)) {
                self.values
                    .write(s.value, t)
                    .map_err(|e| e.context(format!("method `{}` state `{fqn}`", self.name)))?;
                s.on_device = false;
            }
        }
        Ok(())
    }

    /// Run the method. Inputs must match [`Method::input_specs`] in count,
    /// dtype and shape (a dynamic dim: any size up to its bound); float32
    /// given for a bfloat16 input is rounded. Outputs have their actual
    /// shapes.
    pub fn execute(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let specs: Vec<TensorSpec> = self.inputs.iter().map(|(_, s)| s.clone()).collect();
        let inputs = check_inputs(&specs, inputs)
            .map_err(|e| e.context(format!("method `{}`", self.name)))?;
        let views: Vec<View> = inputs.iter().map(View::of).collect();
        let report = self.run(&views)?;
        let outputs = trace::span(
            || format!("method `{}`: outputs out of planned memory", self.name),
            None,
            || {
                self.outputs
                    .iter()
                    .enumerate()
                    .map(|(i, (v, _))| {
                        self.values
                            .read(*v)
                            .map_err(|e| e.context(format!("output {i}")))
                    })
                    .collect()
            },
        );
        print_report(report);
        outputs
    }

    /// [`Method::execute`] on borrowed inputs, each of exactly its input's
    /// dtype (nothing is rounded), handing each output to `output` where
    /// the method keeps it (its actual shape; valid for the call only), so
    /// that an embedder copies inputs and outputs once each, straight
    /// between its own buffers and planned memory. An error from `output`
    /// ends the call with it.
    pub fn execute_borrowed(
        &mut self,
        inputs: &[View<'_>],
        output: &mut dyn FnMut(usize, View<'_>) -> Result<()>,
    ) -> Result<()> {
        let specs: Vec<TensorSpec> = self.inputs.iter().map(|(_, s)| s.clone()).collect();
        check_views(&specs, inputs).map_err(|e| e.context(format!("method `{}`", self.name)))?;
        let report = self.run(inputs)?;
        let done = trace::span(
            || format!("method `{}`: outputs out of planned memory", self.name),
            None,
            || {
                self.outputs.iter().enumerate().try_for_each(|(i, (v, _))| {
                    let view = self
                        .values
                        .view(*v)
                        .map_err(|e| e.context(format!("output {i}")))?;
                    output(i, view)
                })
            },
        );
        print_report(report);
        done
    }

    /// Write checked `inputs` into planned memory and run every step; the
    /// trace so far (empty unless tracing).
    fn run(&mut self, inputs: &[View<'_>]) -> Result<String> {
        let bytes = inputs.iter().map(|t| t.bytes.len() as u64).sum();
        trace::span(
            || format!("method `{}`: inputs into planned memory", self.name),
            Some(bytes),
            || {
                for (i, (t, (v, _))) in inputs.iter().zip(&self.inputs).enumerate() {
                    self.values
                        .write_view(*v, *t)
                        .map_err(|e| e.context(format!("input {i}")))?;
                }
                Ok::<(), Error>(())
            },
        )?;
        // (the trace's spans are kept per thread, and the pool may run this
        // on another: the report is taken where the steps ran)
        let run = |m: &mut Method| {
            let name = m.name.clone();
            trace::span(
                || format!("method `{name}`: execute"),
                None,
                || {
                    let mut pc = 0;
                    while pc < m.steps.len() {
                        let what = trace::enabled().then(|| m.steps[pc].describe());
                        pc = trace::span(
                            || format!("[{pc}] {}", what.unwrap_or_default()),
                            None,
                            || m.step(pc),
                        )
                        .map_err(|e| e.context(format!("method `{}` instruction {pc}", m.name)))?;
                    }
                    Ok::<(), Error>(())
                },
            )?;
            Ok::<String, Error>(trace::take_report())
        };
        // On a worker of rayon's pool, CPU kernels' parallel loops share work
        // with the other workers directly; from another thread each of them
        // would hand its work to the pool and sleep until it is done. A
        // method without CPU kernels runs on the caller's thread: entering
        // the pool costs two thread wake-ups, tens of µs per execute.
        let cpu = self.steps.iter().any(|s| {
            matches!(
                s,
                PreparedInstruction::Kernel { .. } | PreparedInstruction::DynamicKernel { .. }
            )
        });
        let before = trace::take_report();
        let report = match cpu {
            true => rayon::scope(|_| run(self))?,
            false => run(self)?,
        };
        Ok(before + &report)
    }

    /// Run instruction `pc`; the next instruction's index.
    fn step(&mut self, pc: usize) -> Result<usize> {
        let values = &mut self.values;
        let states = &mut self.states;
        if let PreparedInstruction::Delegate {
            id,
            args,
            outputs,
            handle,
            ..
        } = &self.steps[pc]
        {
            delegate_shapes(values, id, handle.as_ref(), args, *outputs)?;
        }
        match &mut self.steps[pc] {
            PreparedInstruction::Kernel { name, ops } => {
                for o in ops.iter() {
                    run_op(values, o).map_err(|e| e.context(format!("kernel {name}")))?;
                }
            }
            PreparedInstruction::DynamicKernel {
                name,
                operator,
                args,
            } => {
                let at = |e: Error| e.context(format!("kernel {name}"));
                let call = decode_call(values.table(), operator, args).map_err(at)?;
                for d in call.ops {
                    let o = Method::prepare(values, d.op, &d.inputs, d.outputs).map_err(at)?;
                    run_op(values, &o).map_err(at)?;
                }
            }
            PreparedInstruction::Sym { name, call } => {
                run_sym(values, call).map_err(|e| e.context(format!("kernel {name}")))?
            }
            PreparedInstruction::Delegate {
                id,
                handle,
                args,
                outputs,
                resident,
            } => {
                let (ins, outs) = args.split_at(args.len() - *outputs);
                // the arguments that are no tensor to lend: scalars, and
                // resident state whose device copy is current
                let scalars = ins
                    .iter()
                    .enumerate()
                    .map(|(k, &v)| {
                        let kept = resident.iter().find(|(p, _)| *p == k);
                        if kept.is_some_and(|&(_, s)| states[s].on_device) {
                            return Ok(Some(DelegateArg::Resident));
                        }
                        Ok(match values.get(v)? {
                            Slot::Tensor(_) => None,
                            Slot::Value(EValue::Int(i)) => Some(DelegateArg::Int(*i)),
                            Slot::Value(EValue::Double(d)) => Some(DelegateArg::Double(*d)),
                            Slot::Value(EValue::Bool(b)) => Some(DelegateArg::Bool(*b)),
                            Slot::Value(_) => Some(DelegateArg::Other),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let reads: Vec<Option<usize>> = ins
                    .iter()
                    .zip(&scalars)
                    .map(|(&v, a)| a.is_none().then_some(v))
                    .collect();
                // Tensor inputs are lent where they live; only when one
                // overlaps an output (or has no value yet) are they copied,
                // before the delegate writes.
                let lend = values.views(&reads, outs)?.is_some();
                let copies = match lend {
                    true => vec![],
                    false => trace::span(
                        || format!("delegate `{id}`: inputs copied (one overlaps an output)"),
                        None,
                        || {
                            reads
                                .iter()
                                .map(|r| r.map(|v| values.read(v)).transpose())
                                .collect::<Result<Vec<_>>>()
                        },
                    )?,
                };
                let lent_reads = match lend {
                    true => reads,
                    false => vec![None; ins.len()],
                };
                // outputs are written where they live, not copied back
                let Some((lent, written)) = values.views(&lent_reads, outs)? else {
                    return Err(Error::unsupported(format!(
                        "delegate `{id}`: its outputs {outs:?} must lie in planned memory, \
                         apart from each other"
                    )));
                };
                let mut call = Vec::with_capacity(args.len());
                for (k, (scalar, view)) in scalars.into_iter().zip(lent).enumerate() {
                    let copy = || copies.get(k).and_then(Option::as_ref).map(View::of);
                    call.push(match (scalar, view.or_else(copy)) {
                        (Some(arg), _) => arg,
                        (None, Some(view)) => DelegateArg::Tensor(view),
                        (None, None) => {
                            return Err(Error::internal(format!(
                                "delegate `{id}`: input {k} was neither lent nor copied"
                            )))
                        }
                    });
                }
                call.extend(written.into_iter().map(DelegateArg::Output));
                handle
                    .execute(&mut call)
                    .map_err(|e| e.context(format!("delegate `{id}`")))?;
                resident
                    .iter()
                    .for_each(|&(_, s)| states[s].on_device = true);
            }
            PreparedInstruction::Move { from, to } => values.assign(*from, *to)?,
            PreparedInstruction::JumpFalse { cond, dest } => {
                let go_on = match values.get(*cond)? {
                    Slot::Value(EValue::Bool(b)) => *b,
                    Slot::Tensor(_) => values.read(*cond)?.to_i64_vec().iter().all(|&x| x != 0),
                    Slot::Value(e) => {
                        return Err(Error::format(format!(
                            "jump condition value {cond} is {e:?}"
                        )))
                    }
                };
                if !go_on {
                    return Ok(*dest);
                }
            }
            PreparedInstruction::Free => {}
        }
        Ok(pc + 1)
    }
}

fn run_op(values: &mut Values, o: &PreparedOp) -> Result<()> {
    // a copy onto itself (a buffer's write-back planned in place) does nothing
    if let (Op::Identity | Op::Cast { .. }, [Some(Operand::Value(x))], [y]) =
        (&o.op, o.inputs.as_slice(), o.outputs.as_slice())
    {
        if values.same_tensor(*x, *y) {
            return Ok(());
        }
    }
    // a view planned on its input's bytes (ExecuTorch's `et_view`) only
    // takes its shape
    if let (Op::Reshape { shape }, [Some(Operand::Value(x))], [y]) =
        (&o.op, o.inputs.as_slice(), o.outputs.as_slice())
    {
        if values.same_start(*x, *y) {
            let from = &values.tensor_slot(*x)?.shape;
            if etmetal_core::shape::numel(from)? != etmetal_core::shape::numel(shape)? {
                return Err(Error::shape(format!(
                    "cannot view value {x} of shape {from:?} as {shape:?}"
                )));
            }
            return values.set_shape(*y, shape);
        }
    }
    // A dynamic output takes the shape the kernel computes: the fast
    // path's when one takes the op, else the reference kernel's.
    let dynamic = o.bounded.iter().any(|&b| b) && !known_shape(values, o)?;
    let reads: Vec<Option<usize>> = o
        .inputs
        .iter()
        .map(|i| match i {
            Some(Operand::Value(v)) => Some(*v),
            _ => None,
        })
        .collect();
    let fast = if dynamic {
        None
    } else {
        values.views(&reads, &o.outputs)?
    };
    if let Some((mut ins, mut outs)) = fast {
        for (view, operand) in ins.iter_mut().zip(&o.inputs) {
            if let Some(Operand::Scalar(t)) = operand {
                *view = Some(etmetal_cpu::View::of(t));
            }
        }
        if etmetal_cpu::execute_into(&o.op, &ins, &mut outs)? {
            return Ok(());
        }
    }
    if std::env::var_os("ETMETAL_DECLINE").is_some() {
        eprintln!("NOVIEW {} in {:?} out {:?}", o.op.name(), reads, o.outputs);
    }
    // The reference kernels on copies (constants are shared, not copied).
    // Inputs are copied out before any output is written, so in-place and
    // aliasing calls read what was there before.
    let owned = o
        .inputs
        .iter()
        .map(|i| match i {
            Some(Operand::Value(v)) => values.read(*v).map(Some),
            Some(Operand::Scalar(t)) => Ok(Some(t.clone())),
            None => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<Option<&Tensor>> = owned.iter().map(Option::as_ref).collect();
    let results = etmetal_cpu::execute_bounded(&o.op, &refs, &o.specs, &o.bounded)?;
    for (&v, t) in o.outputs.iter().zip(&results) {
        values.write(v, t)?;
    }
    Ok(())
}

/// Give the one dynamic output of `o` its shape before the kernel runs,
/// where [`etmetal_cpu::output_shape`] knows it (false otherwise): an error
/// if it is outside the bound, before anything that size is allocated.
fn known_shape(values: &mut Values, o: &PreparedOp) -> Result<bool> {
    let [out] = o.outputs[..] else {
        return Ok(false);
    };
    let shapes: Vec<Option<Vec<usize>>> = o
        .inputs
        .iter()
        .map(|i| match i {
            Some(Operand::Value(v)) => values.tensor_slot(*v).ok().map(|t| t.shape.clone()),
            Some(Operand::Scalar(t)) => Some(t.shape().to_vec()),
            None => None,
        })
        .collect();
    let shapes: Vec<Option<&[usize]>> = shapes.iter().map(Option::as_deref).collect();
    let Some(shape) = etmetal_cpu::output_shape(&o.op, &shapes) else {
        return Ok(false);
    };
    values
        .set_shape(out, &shape)
        .map_err(|e| e.context(o.op.name()))?;
    Ok(true)
}

/// Ask each delegate which mutable buffers it keeps resident, and check
/// that nothing else (another instruction, the method's inputs or outputs)
/// touches them, since their host copy goes stale.
fn resident_state(
    steps: &mut [PreparedInstruction],
    states: &mut [State],
    io: &[usize],
) -> Result<()> {
    let mut kept = vec![];
    for (k, step) in steps.iter_mut().enumerate() {
        let PreparedInstruction::Delegate {
            id,
            handle,
            args,
            resident,
            ..
        } = step
        else {
            continue;
        };
        for position in handle.resident_args() {
            let v = *args.get(position).ok_or_else(|| {
                Error::format(format!(
                    "instruction {k}: delegate `{id}` keeps argument {position} resident, \
                     but the call has {} arguments",
                    args.len()
                ))
            })?;
            let s = states
                .iter()
                .position(|s| s.value == v && s.keeper.is_none())
                .ok_or_else(|| {
                    Error::format(format!(
                        "instruction {k}: delegate `{id}` keeps value {v} resident, which is not \
                         a mutable buffer (or is kept by another delegate)"
                    ))
                })?;
            states[s].keeper = Some((k, position));
            resident.push((position, s));
            kept.push((v, k, position));
        }
    }
    for (v, keeper, position) in kept {
        let touched = io.contains(&v)
            || steps.iter().enumerate().any(|(k, step)| match step {
                PreparedInstruction::Kernel { ops, .. } => ops.iter().any(|o| {
                    o.outputs.contains(&v)
                        || o.inputs
                            .iter()
                            .any(|i| matches!(i, Some(Operand::Value(x)) if *x == v))
                }),
                PreparedInstruction::Delegate { args, .. } => args
                    .iter()
                    .enumerate()
                    .any(|(p, &a)| a == v && (k, p) != (keeper, position)),
                PreparedInstruction::DynamicKernel { args, .. } => args.contains(&(v as i32)),
                PreparedInstruction::Sym { .. } => false,
                PreparedInstruction::Move { from, to } => *from == v || *to == v,
                PreparedInstruction::JumpFalse { cond, .. } => *cond == v,
                PreparedInstruction::Free => false,
            });
        if touched {
            return Err(Error::format(format!(
                "instruction {keeper}: a delegate keeps mutable buffer value {v} on its device, \
                 but other instructions or the method's inputs/outputs use it"
            )));
        }
    }
    Ok(())
}

/// The GPU delegate runs the static shapes it was compiled for: a dynamic
/// input must be at its bound (an error otherwise), and a dynamic output
/// takes it.
/// Give a delegate's dynamic outputs their shapes for this execute: those
/// the delegate computes from its inputs' shapes, or, for a delegate of
/// static shapes (whose dynamic inputs must be at their bound), the bound.
fn delegate_shapes(
    values: &mut Values,
    id: &str,
    handle: &dyn DelegateHandle,
    args: &[usize],
    outputs: usize,
) -> Result<()> {
    let inputs = args.len().saturating_sub(outputs);
    let shapes: Vec<Option<&[usize]>> = args[..inputs]
        .iter()
        .map(|&v| values.tensor_slot(v).ok().map(|t| t.shape.as_slice()))
        .collect();
    if let Some(out) = handle.output_shapes(&shapes) {
        let out = out.map_err(|e| e.context(format!("delegate `{id}`")))?;
        for (&v, shape) in args[inputs..].iter().zip(&out) {
            values.set_shape(v, shape)?;
        }
        return Ok(());
    }
    for (k, &v) in args.iter().enumerate() {
        let Ok(t) = values.tensor_slot(v) else {
            continue;
        };
        if !t.dynamic || t.shape == t.bound {
            continue;
        }
        if k < inputs {
            return Err(Error::unsupported(format!(
                "delegate `{id}` was compiled for the static shape {:?} of its input {k} \
                 (value {v}), which is {:?} in this execute; the GPU delegate takes static \
                 shapes only",
                t.bound, t.shape
            )));
        }
        let bound = t.bound.clone();
        values.set_shape(v, &bound)?;
    }
    Ok(())
}

fn check_reads(unwritten: &BTreeMap<usize, String>, reads: &[usize], k: usize) -> Result<()> {
    match reads.iter().find_map(|v| unwritten.get(v).map(|name| (v, name))) {
        Some((v, name)) => Err(Error::unsupported(format!(
            "instruction {k} reads value {v}, an extra output of {name} that etmetal does not compute"
        ))),
        None => Ok(()),
    }
}
