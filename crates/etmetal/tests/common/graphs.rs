//! Small graphs more than one test file builds.
#![allow(dead_code)] // each test file uses part of it

use etmetal_core::{BinaryOp, DType, Op, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind};

/// `acc += x; return acc * 2`, with `acc` a registered buffer starting at
/// `init` (1-D; its dtype and length are the graph's).
pub fn accumulator(init: Tensor) -> Graph {
    let (dtype, n) = (init.dtype(), init.numel());
    let mut g = Graph::default();
    let acc = g.add_constant("b_acc", init);
    g.inputs.push((
        acc,
        InputKind::Buffer {
            fqn: "acc".into(),
            persistent: true,
        },
    ));
    let x = g.add_value("x", dtype, vec![n]);
    g.inputs.push((x, InputKind::User));
    let two = match dtype {
        DType::I64 => Tensor::from_i64(dtype, &[], &[2]).unwrap(),
        _ => Tensor::from_f32(dtype, &[], &[2.0]).unwrap(),
    };
    let two = g.add_constant("two", two);
    let new = g.add_value("new", dtype, vec![n]);
    let y = g.add_value("y", dtype, vec![n]);
    for (name, op, a, b, out) in [
        ("add", BinaryOp::Add, acc, x, new),
        ("mul", BinaryOp::Mul, new, two, y),
    ] {
        g.nodes.push(Node {
            name: name.into(),
            target: "test".into(),
            op: Op::Binary(op),
            inputs: vec![Some(a), Some(b)],
            outputs: vec![out],
        });
    }
    g.outputs
        .push((new, OutputKind::BufferMutation { fqn: "acc".into() }));
    g.outputs.push((y, OutputKind::User));
    g
}
