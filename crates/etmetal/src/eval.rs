//! Evaluate a graph node by node with the CPU kernels.

use std::borrow::Cow;
use std::collections::HashMap;

use etmetal_core::{Error, Result, Tensor};
use etmetal_graph::{Graph, Node, ValueId};

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
        let args: Vec<Option<&Tensor>> = node
            .inputs
            .iter()
            .map(|slot| match slot {
                None => Ok(None),
                Some(v) => env[v.0].as_deref().map(Some).ok_or_else(|| {
                    Error::internal(format!(
                        "value `{}` is read before it is computed",
                        graph.value(*v).name
                    ))
                }),
            })
            .collect::<Result<_>>()
            .map_err(|e| e.context(at()))?;
        observe(node, &args).map_err(|e| e.context(at()))?;
        if skip {
            continue;
        }
        let specs: Vec<_> = node
            .outputs
            .iter()
            .map(|v| (graph.value(*v).dtype, graph.value(*v).shape.clone()))
            .collect();
        let results = etmetal_cpu::execute(&node.op, &args, &specs).map_err(|e| e.context(at()))?;
        if results.len() != node.outputs.len() {
            return Err(Error::internal(format!(
                "node `{}`: kernel {} returned {} outputs, the graph has {}",
                node.name,
                node.op.name(),
                results.len(),
                node.outputs.len()
            )));
        }
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
