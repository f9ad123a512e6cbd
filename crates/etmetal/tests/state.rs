//! Buffer mutations compiled to a `.pte`: the state persists across
//! executes of one loaded method, starts from the buffer's value in the
//! file, and `reset_state` restores it (CPU backend; the GPU path is in the
//! parity suite's decoder tests).

use etmetal::compile::compile_cpu;
use etmetal_core::{BinaryOp, DType, Op, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind};
use etmetal_pte::Instruction;

/// `acc += x; return acc * 2` with `acc` a registered buffer starting at `[1, 2]`.
fn accumulator() -> Graph {
    let mut g = Graph::default();
    let acc = g.add_constant(
        "b_acc",
        Tensor::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap(),
    );
    g.inputs.push((
        acc,
        InputKind::Buffer {
            fqn: "acc".into(),
            persistent: true,
        },
    ));
    let x = g.add_value("x", DType::F32, vec![2]);
    g.inputs.push((x, InputKind::User));
    let two = g.add_constant("two", Tensor::from_f32(DType::F32, &[], &[2.0]).unwrap());
    let new = g.add_value("new", DType::F32, vec![2]);
    let y = g.add_value("y", DType::F32, vec![2]);
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

#[test]
fn buffer_state_persists_across_executes_and_resets() {
    let bytes = compile_cpu(&accumulator()).unwrap();
    let file = etmetal_pte::parse(&bytes).unwrap();
    let plan = &file.program.execution_plan[0];
    // ExecuTorch's encoding: one user input, the write-back copy_ last
    assert_eq!(plan.inputs.len(), 1);
    assert_eq!(plan.outputs.len(), 1);
    assert_eq!(file.program.mutable_data_segments.len(), 1);
    let Some(Instruction::KernelCall(last)) = plan.chains[0].instructions.last() else {
        panic!("no kernel call at the end")
    };
    assert_eq!(
        plan.operators[last.op_index as usize].qualified_name(),
        "aten::copy_"
    );

    let program = etmetal_runtime::Program::from_bytes(&bytes).unwrap();
    let mut method = program.method("forward").unwrap();
    let x = || vec![Tensor::from_f32(DType::F32, &[2], &[10.0, 20.0]).unwrap()];
    let run = |m: &mut etmetal_runtime::Method| m.execute(x()).unwrap()[0].to_f64_vec();
    assert_eq!(run(&mut method), [22.0, 44.0]);
    assert_eq!(run(&mut method), [42.0, 84.0]);
    assert_eq!(run(&mut method), [62.0, 124.0]);
    method.reset_state().unwrap();
    assert_eq!(run(&mut method), [22.0, 44.0]);
    // a second method of the same program starts from the file's value
    let mut fresh = program.method("forward").unwrap();
    assert_eq!(run(&mut fresh), [22.0, 44.0]);
    assert_eq!(run(&mut method), [42.0, 84.0]);
}
