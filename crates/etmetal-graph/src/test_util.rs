//! Helpers of the passes' tests: building graphs node by node and checking
//! them.

use etmetal_core::{Op, Tensor};

use crate::infer::infer;
use crate::ir::{Graph, Node, ValueId};

/// The ops of the graph's nodes, by name, in order.
pub fn ops(g: &Graph) -> Vec<&'static str> {
    g.nodes.iter().map(|n| n.op.name()).collect()
}

/// Append node `name` computing `op` of `inputs`; its output is a new value
/// of the inferred dtype and shape.
pub fn push(g: &mut Graph, name: &str, op: Op, inputs: Vec<Option<ValueId>>) -> ValueId {
    let mut n = Node {
        name: name.into(),
        target: "test".into(),
        op,
        inputs,
        outputs: vec![],
    };
    let (d, s) = infer(g, &n).unwrap().remove(0);
    let v = g.add_value(name, d, s);
    n.outputs.push(v);
    g.nodes.push(n);
    v
}

/// Every node re-infers to the dtypes and shapes of its outputs.
pub fn reinfers(g: &Graph) {
    for n in &g.nodes {
        let got = infer(g, n).unwrap();
        let want: Vec<_> = n
            .outputs
            .iter()
            .map(|v| (g.value(*v).dtype, g.value(*v).shape.clone()))
            .collect();
        assert_eq!(got, want, "node {}", n.name);
    }
}

/// `g` run node by node on the CPU kernels with its user inputs `inputs`:
/// its outputs.
pub fn run(g: &Graph, inputs: Vec<Tensor>) -> Vec<Tensor> {
    let mut env: Vec<Option<Tensor>> = vec![None; g.values.len()];
    for (id, t) in &g.constants {
        env[id.0] = Some(t.clone());
    }
    for (id, t) in g.user_inputs().zip(inputs) {
        env[id.0] = Some(t);
    }
    for n in &g.nodes {
        let args: Vec<Option<&Tensor>> = (n.inputs.iter())
            .map(|v| v.map(|v| env[v.0].as_ref().expect("computed before")))
            .collect();
        let specs: Vec<_> = (n.outputs.iter())
            .map(|&v| (g.value(v).dtype, g.value(v).shape.clone()))
            .collect();
        let outs = etmetal_cpu::execute(&n.op, &args, &specs)
            .unwrap_or_else(|e| panic!("node `{}`: {e}", n.name));
        for (v, t) in n.outputs.iter().zip(outs) {
            env[v.0] = Some(t);
        }
    }
    (g.outputs.iter())
        .map(|(v, _)| env[v.0].clone().expect("an output"))
        .collect()
}
