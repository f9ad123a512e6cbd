//! int64 on the GPU, where it is computed as i32: exact ops (comparisons,
//! min/max, where, sign, casts) agree with the CPU kernels at the edges of
//! i32, and checked arithmetic (add, sub, mul, neg, abs, division, sum,
//! prod, cumsum, float-to-int64 casts) agrees below the edges and fails the
//! execute with an error naming the kernel and node beyond them, never a
//! wrapped number. The method runs again correctly after a failed execute.

mod common;

use common::gpu::{compile_whole, load_method, random, OpCase};
use etmetal_core::{BinaryOp, DType, Error, ErrorKind, Op, ReduceOp, Tensor, UnaryOp};
use etmetal_graph::{Graph, InputKind, Node, OutputKind};
use etmetal_runtime::Method;

const MAX: i64 = i32::MAX as i64;
const MIN: i64 = i32::MIN as i64;

fn ints(dtype: DType, v: &[i64]) -> Tensor {
    Tensor::from_i64(dtype, &[v.len()], v).unwrap()
}

fn i64s(v: &[i64]) -> Tensor {
    ints(DType::I64, v)
}

/// The error of an execute that must fail.
fn gpu_error(method: &mut Method, inputs: Vec<Tensor>, what: &str) -> Error {
    match method.execute(inputs) {
        Ok(out) => panic!("{what}: expected an error, the GPU gave {out:?}"),
        Err(e) => e,
    }
}

/// `graph` on the CPU (which computes int64 exactly) and `method` on the
/// GPU agree on `inputs`.
fn agrees(method: &mut Method, graph: &Graph, inputs: Vec<Tensor>, what: &str) {
    let want = etmetal::eval::run_graph(graph, inputs.clone())
        .unwrap_or_else(|e| panic!("{what}: CPU reference: {e}"));
    let got = method
        .execute(inputs)
        .unwrap_or_else(|e| panic!("{what}: GPU: {e}"));
    for (g, w) in got.iter().zip(&want) {
        common::gpu::assert_close(g, w, 0.0, what);
    }
}

/// One compiled `op` over int64 vectors: every `ok` input set matches the
/// CPU, every `overflow` set fails with the overflow error naming the node
/// and op (one element a run, so each edge case is the only one), and a
/// good run after the failures still matches.
fn checked_op(op: Op, inputs: usize, ok: &[Vec<i64>], overflow: &[Vec<i64>]) {
    let name = op.name();
    let case = (0..inputs).fold(OpCase::new(op), |c, _| c.input(i64s(&[0])));
    let (graph, _) = case.build();
    let mut method = load_method(&compile_whole(&graph));
    for set in ok {
        let args = set.iter().map(|&v| i64s(&[v])).collect();
        agrees(&mut method, &graph, args, &format!("{name} {set:?}"));
    }
    for set in overflow {
        let args: Vec<Tensor> = set.iter().map(|&v| i64s(&[v])).collect();
        // the CPU has the exact int64 answer; the GPU must refuse, not wrap
        etmetal::eval::run_graph(&graph, args.clone()).unwrap();
        let e = gpu_error(&mut method, args, &format!("{name} {set:?}"));
        let msg = e.to_string();
        assert_eq!(e.kind(), ErrorKind::Limit, "{msg}");
        for word in [
            "int64 arithmetic in kernel k",
            "(node `op`)",
            "overflowed the GPU's 32-bit integers",
            &format!("--skip-op {name} or --backend cpu"),
        ] {
            assert!(msg.contains(word), "{name} {set:?}: `{word}` not in: {msg}");
        }
    }
    let set = &ok[0];
    let args = set.iter().map(|&v| i64s(&[v])).collect();
    agrees(&mut method, &graph, args, &format!("{name} {set:?} again"));
}

fn pairs(v: &[(i64, i64)]) -> Vec<Vec<i64>> {
    v.iter().map(|&(a, b)| vec![a, b]).collect()
}

#[test]
fn add_sub_mul_at_the_i32_edges() {
    let add = Op::Binary(BinaryOp::Add);
    checked_op(
        add,
        2,
        &pairs(&[
            (MAX, 0),
            (MAX - 1, 1),
            (MIN, 0),
            (MIN + 1, -1),
            (MIN, MAX),
            (-1, 0),
        ]),
        &pairs(&[(MAX, 1), (1, MAX), (MIN, -1), (MIN, MIN), (MAX, MAX)]),
    );
    let sub = Op::Binary(BinaryOp::Sub);
    checked_op(
        sub,
        2,
        &pairs(&[
            (-1, MIN),
            (MIN, 0),
            (0, MAX),
            (MAX, MAX),
            (MIN + 1, 1),
            (0, -1),
        ]),
        &pairs(&[(0, MIN), (MIN, 1), (MAX, -1), (MAX, MIN), (MIN, MAX)]),
    );
    // 46340² is below 2^31, 46341² above; -65536 * 32768 is exactly MIN
    let mul = Op::Binary(BinaryOp::Mul);
    checked_op(
        mul,
        2,
        &pairs(&[
            (46340, 46340),
            (-46340, 46340),
            (-65536, 32768),
            (MIN, 1),
            (MAX, -1),
            (-1, MAX),
            (MIN, 0),
            (0, MIN),
            (-1, -1),
        ]),
        &pairs(&[
            (46341, 46341),
            (-46341, 46341),
            (65536, 32768),
            (-65536, -32768),
            (MIN, -1),
            (-1, MIN),
            (MAX, 2),
            (MIN, MIN),
        ]),
    );
}

#[test]
fn neg_and_abs_of_i32_min_overflow() {
    for u in [UnaryOp::Neg, UnaryOp::Abs] {
        let ok = [vec![MAX], vec![MIN + 1], vec![-1], vec![0]];
        checked_op(Op::Unary(u), 1, &ok, &[vec![MIN]]);
    }
}

#[test]
fn floor_and_trunc_division_and_remainder() {
    let ok = pairs(&[
        (7, -2),
        (-7, 2),
        (MIN, 1),
        (MIN, 2),
        (MAX, -1),
        (MIN, MAX),
        (0, -5),
    ]);
    for b in [BinaryOp::FloorDiv, BinaryOp::TruncDiv] {
        // MIN / -1 is 2^31
        checked_op(Op::Binary(b), 2, &ok, &pairs(&[(MIN, -1)]));
    }
    let mut rem_ok = ok.clone();
    rem_ok.push(vec![MIN, -1]);
    checked_op(Op::Binary(BinaryOp::Remainder), 2, &rem_ok, &[]);
}

#[test]
fn integer_division_by_zero_is_an_error_as_on_the_cpu() {
    for dtype in [DType::I64, DType::I32] {
        for b in [BinaryOp::FloorDiv, BinaryOp::TruncDiv, BinaryOp::Remainder] {
            let (graph, _) = OpCase::new(Op::Binary(b))
                .input(ints(dtype, &[0, 0, 0]))
                .input(ints(dtype, &[0, 0, 0]))
                .build();
            let args = vec![ints(dtype, &[5, -3, 7]), ints(dtype, &[2, 0, 1])];
            let cpu = etmetal::eval::run_graph(&graph, args.clone()).unwrap_err();
            assert!(cpu.to_string().contains("division by zero"), "{cpu}");
            let mut method = load_method(&compile_whole(&graph));
            let e = gpu_error(&mut method, args, &format!("{b:?} {dtype:?}"));
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains("integer division by zero in kernel k") && msg.contains("node `op`"),
                "{msg}"
            );
        }
    }
}

#[test]
fn sum_prod_and_cumsum_of_int64() {
    let sum = |op| Op::Reduce {
        op,
        dims: vec![0],
        keepdim: false,
    };
    checked_op(
        sum(ReduceOp::Sum),
        1,
        &[vec![MAX], vec![MIN], vec![-1]],
        &[],
    );
    // reductions over a row: a vector input each
    let rows = |op: Op, ok: &[&[i64]], overflow: &[&[i64]]| {
        let name = op.name();
        let (graph, _) = OpCase::new(op).input(i64s(&[0; 5])).build();
        let mut method = load_method(&compile_whole(&graph));
        for v in ok {
            agrees(&mut method, &graph, vec![i64s(v)], &format!("{name} {v:?}"));
        }
        for v in overflow {
            let e = gpu_error(&mut method, vec![i64s(v)], &format!("{name} {v:?}"));
            let msg = e.to_string();
            assert!(
                msg.contains("overflowed") && msg.contains(&format!("--skip-op {name}")),
                "{msg}"
            );
        }
        agrees(&mut method, &graph, vec![i64s(ok[0])], name);
    };
    rows(
        sum(ReduceOp::Sum),
        &[
            &[MAX - 10, 1, 2, 3, 4],
            &[MIN + 10, -1, -2, -3, -4],
            &[MAX, MIN, -1, 1, 0],
        ],
        &[
            &[MAX, 1, 0, 0, 0],
            &[MIN, -1, 0, 0, 0],
            &[MAX / 2, MAX / 2, 2, 0, 0],
        ],
    );
    rows(
        sum(ReduceOp::Prod),
        &[
            &[-65536, 32768, 1, 1, 1],
            &[46340, 46340, 1, -1, -1],
            &[MIN, 1, 1, 1, 1],
        ],
        &[
            &[46341, 46341, 1, 1, 1],
            &[MIN, -1, 1, 1, 1],
            &[65536, 2, 2, 2, 4096],
        ],
    );
    rows(
        Op::CumSum { dim: 0 },
        &[&[MAX - 4, 1, 1, 1, 1], &[MIN, 1, -1, MAX, 0]],
        &[&[MAX - 3, 1, 1, 1, 1], &[MIN, -1, 0, 0, 0]],
    );
    // an int32 sum is int64 in PyTorch: checked too
    let (graph, _) = OpCase::new(sum(ReduceOp::Sum))
        .input(ints(DType::I32, &[0, 0]))
        .build();
    let mut method = load_method(&compile_whole(&graph));
    agrees(
        &mut method,
        &graph,
        vec![ints(DType::I32, &[MAX, 0])],
        "i32 sum",
    );
    gpu_error(&mut method, vec![ints(DType::I32, &[MAX, MAX])], "i32 sum");
}

#[test]
fn exact_ops_on_int64_at_the_i32_edges() {
    let a = i64s(&[MIN, MIN + 1, -1, 0, 1, MAX - 1, MAX, 7]);
    let b = i64s(&[MAX, MIN, -1, 1, 0, MAX, MAX, -7]);
    for op in [
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::BitwiseAnd,
        BinaryOp::BitwiseXor,
    ] {
        OpCase::new(Op::Binary(op))
            .input(a.clone())
            .input(b.clone())
            .check(0.0);
    }
    // int64 against a float promotes to float
    OpCase::new(Op::Binary(BinaryOp::Mul))
        .input(a.clone())
        .input(random(DType::F32, &[8], 3))
        .check(1e-6);
    for u in [
        UnaryOp::Sign,
        UnaryOp::Relu,
        UnaryOp::BitwiseNot,
        UnaryOp::Clamp {
            min: Some(-5.0),
            max: Some(1e12),
        },
    ] {
        OpCase::new(Op::Unary(u)).input(a.clone()).check(0.0);
    }
    for dtype in [DType::F32, DType::BF16, DType::Bool, DType::I32, DType::I64] {
        OpCase::new(Op::Cast { dtype }).input(a.clone()).check(0.0);
    }
    // int32 and bool widen exactly, and the int64 outputs come back as i64
    OpCase::new(Op::Cast { dtype: DType::I64 })
        .input(ints(DType::I32, &[MIN, -1, MAX]))
        .check(0.0);
    OpCase::new(Op::Cast { dtype: DType::I64 })
        .input(ints(DType::Bool, &[1, 0, 1]))
        .check(0.0);
    let cond = Tensor::from_bytes(DType::Bool, &[8], &[1, 0, 1, 1, 0, 0, 1, 0]).unwrap();
    OpCase::new(Op::Where)
        .input(cond)
        .input(a.clone())
        .input(b.clone())
        .check(0.0);
    let argmax = Op::ArgReduce {
        max: true,
        dim: Some(0),
        keepdim: false,
    };
    OpCase::new(argmax).input(a.clone()).check(0.0);
    let amin = Op::Reduce {
        op: ReduceOp::Min,
        dims: vec![0],
        keepdim: false,
    };
    OpCase::new(amin).input(a).check(0.0);
}

#[test]
fn float_to_int64_casts_beyond_i32_are_refused() {
    let (graph, _) = OpCase::new(Op::Cast { dtype: DType::I64 })
        .input(Tensor::from_f32(DType::F32, &[1], &[0.0]).unwrap())
        .build();
    let mut method = load_method(&compile_whole(&graph));
    let f = |v: f32| vec![Tensor::from_f32(DType::F32, &[1], &[v]).unwrap()];
    // the largest f32 below 2^31, -2^31, truncation toward zero
    for v in [2147483520.0, -2147483648.0, -2.7, 2.7] {
        agrees(&mut method, &graph, f(v), &format!("cast {v}"));
    }
    for v in [2147483648.0, -2147483904.0, 1e20, f32::NAN, f32::INFINITY] {
        let msg = gpu_error(&mut method, f(v), &format!("cast {v}")).to_string();
        assert!(
            msg.contains("overflowed") && msg.contains("--skip-op cast"),
            "{msg}"
        );
    }
}

/// `m = x * y` (node `mul_2`), `out = m + z` (node `add_7`): one fused
/// kernel, whose error names the node that overflowed.
#[test]
fn a_fused_kernel_names_the_node_that_overflowed() {
    let mut g = Graph::default();
    let v = |g: &mut Graph, name: &str| g.add_value(name, DType::I64, vec![3]);
    let (x, y, z) = (v(&mut g, "x"), v(&mut g, "y"), v(&mut g, "z"));
    for id in [x, y, z] {
        g.inputs.push((id, InputKind::User));
    }
    let (m, out) = (v(&mut g, "m"), v(&mut g, "out"));
    let node = |name: &str, op, a, b, y| Node {
        name: name.into(),
        target: "test".into(),
        op: Op::Binary(op),
        inputs: vec![Some(a), Some(b)],
        outputs: vec![y],
    };
    g.nodes.push(node("mul_2", BinaryOp::Mul, x, y, m));
    g.nodes.push(node("add_7", BinaryOp::Add, m, z, out));
    g.outputs.push((out, OutputKind::User));
    let c = etmetal::compile::compile(
        &g,
        &etmetal::compile::CompileOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    let payload = &c.methods[0].partitions[0].payload;
    assert_eq!(payload.dispatches.len(), 1, "mul and add fuse");
    assert_eq!(payload.checks.len(), 1);
    let mut method = load_method(&c.pte);
    let args = |x: i64, y: i64, z: i64| vec![i64s(&[1, x, 2]), i64s(&[3, y, 4]), i64s(&[5, z, 6])];
    agrees(&mut method, &g, args(-65536, 32768, -1 - MIN), "fits");
    for (inputs, node, op) in [
        (args(65536, 32768, -5), "mul_2", "mul"),
        (args(65536, 16384, 1 << 30), "add_7", "add"),
    ] {
        let msg = gpu_error(&mut method, inputs, node).to_string();
        assert!(
            msg.contains(&format!("(node `{node}`)"))
                && msg.contains(&format!("--skip-op {op} or")),
            "{node}: {msg}"
        );
    }
    agrees(&mut method, &g, args(2, 3, 4), "after the errors");
}
