//! Evaluate a graph node by node with the CPU kernels: the reference the
//! compiled programs are checked against ([`run_graph`]), the calibration
//! run that watches each node's inputs ([`run_graph_observed`]), and a run
//! kept whole so that one changed weight is re-evaluated cheaply
//! ([`Trace`], [`rerun_from`]). [`crate::fold_constants`] evaluates its
//! nodes with the same `run_node`.

use std::borrow::Cow;
use std::collections::HashMap;

use etmetal_core::{Error, Result, Tensor};

use crate::ir::{Graph, Node, ValueId};

/// For each value, the index of the last node that reads it; values read by
/// no node (graph outputs, unused inputs) have none and are kept.
fn last_uses(graph: &Graph) -> HashMap<ValueId, usize> {
    let mut last = HashMap::new();
    for (i, node) in graph.nodes.iter().enumerate() {
        for v in node.inputs.iter().flatten() {
            last.insert(*v, i);
        }
    }
    for (v, _) in &graph.outputs {
        last.remove(v);
    }
    last
}

/// Run `graph` on `inputs` (one tensor per user input, already checked) and
/// return every graph output in signature order.
pub fn run_graph(graph: &Graph, user_inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
    let outputs = run_graph_observed(
        graph,
        user_inputs,
        &HashMap::new(),
        None,
        &mut |_, _| Ok(()),
    )?;
    graph
        .outputs
        .iter()
        .zip(outputs)
        .map(|((v, _), t)| {
            t.ok_or_else(|| {
                Error::internal(format!(
                    "output `{}` was never computed",
                    graph.value(*v).name
                ))
            })
        })
        .collect()
}

/// What [`run_graph_observed`] calls with each node and its inputs.
pub type Observer<'a> = dyn FnMut(&Node, &[Option<&Tensor>]) -> Result<()> + 'a;

/// [`run_graph`] with constants replaced by `state` (a program's mutable
/// buffers as an earlier call left them), only the nodes `run[i]` marks
/// (all where `None`: outputs of nodes left out are `None`), and
/// `observe` called with each node and its inputs before it runs (a node
/// left out too, where its inputs were computed).
pub fn run_graph_observed(
    graph: &Graph,
    user_inputs: Vec<Tensor>,
    state: &HashMap<ValueId, Tensor>,
    run: Option<&[bool]>,
    observe: &mut Observer<'_>,
) -> Result<Vec<Option<Tensor>>> {
    let mut env: Vec<Option<Cow<Tensor>>> = vec![None; graph.values.len()];
    for (id, tensor) in &graph.constants {
        env[id.0] = Some(Cow::Borrowed(state.get(id).unwrap_or(tensor)));
    }
    for (id, tensor) in graph.user_inputs().zip(user_inputs) {
        env[id.0] = Some(Cow::Owned(tensor));
    }
    let last = last_uses(graph);
    for (index, node) in graph.nodes.iter().enumerate() {
        let skip = run.is_some_and(|r| !r[index]);
        if skip && node.inputs.iter().flatten().any(|v| env[v.0].is_none()) {
            continue;
        }
        let at = || format!("node `{}` ({})", node.name, node.target);
        let args = node_args(graph, node, |v| env[v.0].as_deref())?;
        observe(node, &args).map_err(|e| e.context(at()))?;
        if skip {
            continue;
        }
        let results = execute_node(graph, node, &args)?;
        for (v, t) in node.outputs.iter().zip(results) {
            env[v.0] = Some(Cow::Owned(t));
        }
        for v in node.inputs.iter().flatten() {
            if last.get(v) == Some(&index) && !graph.constants.contains_key(v) {
                env[v.0] = None;
            }
        }
    }
    Ok(graph
        .outputs
        .iter()
        .map(|(v, _)| env[v.0].as_deref().cloned())
        .collect())
}

/// Every value of one run of `graph` (constants replaced by `state`, as in
/// [`run_graph_observed`]), kept so that [`rerun_from`] can recompute
/// only what one changed constant reaches.
pub struct Trace {
    values: Vec<Option<Tensor>>,
}

impl Trace {
    /// Run `graph` on `user_inputs`, keeping every value.
    pub fn new(
        graph: &Graph,
        user_inputs: Vec<Tensor>,
        state: &HashMap<ValueId, Tensor>,
    ) -> Result<Trace> {
        let mut values: Vec<Option<Tensor>> = vec![None; graph.values.len()];
        for (id, tensor) in &graph.constants {
            values[id.0] = Some(state.get(id).unwrap_or(tensor).clone());
        }
        for (id, tensor) in graph.user_inputs().zip(user_inputs) {
            values[id.0] = Some(tensor);
        }
        for node in &graph.nodes {
            let results = run_node(graph, node, |v| values[v.0].as_ref())?;
            for (v, t) in node.outputs.iter().zip(results) {
                values[v.0] = Some(t);
            }
        }
        Ok(Trace { values })
    }

    /// The value `v` of the run.
    pub fn value(&self, v: ValueId) -> Option<&Tensor> {
        self.values[v.0].as_ref()
    }
}

/// Value `want` of `graph` with constant `changed` replaced by `tensor`:
/// the nodes it reaches run again, every other value is `trace`'s.
pub fn rerun_from(
    graph: &Graph,
    trace: &Trace,
    changed: ValueId,
    tensor: &Tensor,
    want: ValueId,
) -> Result<Tensor> {
    let mut new: HashMap<ValueId, Tensor> = HashMap::from([(changed, tensor.clone())]);
    for node in &graph.nodes {
        if !node.inputs.iter().flatten().any(|v| new.contains_key(v)) {
            continue;
        }
        let results = run_node(graph, node, |v| new.get(&v).or(trace.value(v)))?;
        for (v, t) in node.outputs.iter().zip(results) {
            new.insert(*v, t);
        }
    }
    new.remove(&want)
        .or_else(|| trace.value(want).cloned())
        .ok_or_else(|| {
            Error::internal(format!(
                "value `{}` was never computed",
                graph.value(want).name
            ))
        })
}

/// One node on the CPU kernels, its inputs read through `get`.
pub(crate) fn run_node<'a>(
    graph: &Graph,
    node: &Node,
    get: impl Fn(ValueId) -> Option<&'a Tensor>,
) -> Result<Vec<Tensor>> {
    execute_node(graph, node, &node_args(graph, node, get)?)
}

/// The inputs of `node`, read through `get` (an absent optional input is
/// `None`; a value not computed yet is an error naming it).
fn node_args<'a>(
    graph: &Graph,
    node: &Node,
    get: impl Fn(ValueId) -> Option<&'a Tensor>,
) -> Result<Vec<Option<&'a Tensor>>> {
    node.inputs
        .iter()
        .map(|slot| match slot {
            None => Ok(None),
            Some(v) => get(*v).map(Some).ok_or_else(|| {
                Error::internal(format!(
                    "value `{}` is read before it is computed",
                    graph.value(*v).name
                ))
            }),
        })
        .collect::<Result<_>>()
        .map_err(|e| e.context(format!("node `{}` ({})", node.name, node.target)))
}

/// `node` on the CPU kernels, given its inputs: one result per output.
fn execute_node(graph: &Graph, node: &Node, args: &[Option<&Tensor>]) -> Result<Vec<Tensor>> {
    let at = || format!("node `{}` ({})", node.name, node.target);
    let specs: Vec<_> = node
        .outputs
        .iter()
        .map(|v| (graph.value(*v).dtype, graph.value(*v).shape.clone()))
        .collect();
    let results = etmetal_cpu::execute(&node.op, args, &specs).map_err(|e| e.context(at()))?;
    if results.len() != node.outputs.len() {
        return Err(Error::internal(format!(
            "node `{}`: kernel {} returned {} outputs, the graph has {}",
            node.name,
            node.op.name(),
            results.len(),
            node.outputs.len()
        )));
    }
    Ok(results)
}
