//! Evaluate a graph node by node with the CPU kernels.

use std::collections::HashMap;

use etmetal_core::{Error, Result, Tensor};
use etmetal_graph::{Graph, ValueId};

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
    let mut env: Vec<Option<Tensor>> = vec![None; graph.values.len()];
    for (id, tensor) in &graph.constants {
        env[id.0] = Some(tensor.clone());
    }
    for (id, tensor) in graph.user_inputs().zip(user_inputs) {
        env[id.0] = Some(tensor);
    }
    let last = last_uses(graph);
    for (index, node) in graph.nodes.iter().enumerate() {
        let args: Vec<Option<&Tensor>> = node
            .inputs
            .iter()
            .map(|slot| match slot {
                None => Ok(None),
                Some(v) => env[v.0].as_ref().map(Some).ok_or_else(|| {
                    Error::internal(format!(
                        "value `{}` is read before it is computed",
                        graph.value(*v).name
                    ))
                }),
            })
            .collect::<Result<_>>()
            .map_err(|e| e.context(format!("node `{}` ({})", node.name, node.target)))?;
        let specs: Vec<_> = node
            .outputs
            .iter()
            .map(|v| (graph.value(*v).dtype, graph.value(*v).shape.clone()))
            .collect();
        let results = etmetal_cpu::execute(&node.op, &args, &specs)
            .map_err(|e| e.context(format!("node `{}` ({})", node.name, node.target)))?;
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
            env[v.0] = Some(t);
        }
        for v in node.inputs.iter().flatten() {
            if last.get(v) == Some(&index) && !graph.constants.contains_key(v) {
                env[v.0] = None;
            }
        }
    }
    graph
        .outputs
        .iter()
        .map(|(v, _)| {
            env[v.0].clone().ok_or_else(|| {
                Error::internal(format!(
                    "output `{}` was never computed",
                    graph.value(*v).name
                ))
            })
        })
        .collect()
}
