//! Helpers of the passes' tests: building graphs node by node and checking
//! them.

use etmetal_core::Op;

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
