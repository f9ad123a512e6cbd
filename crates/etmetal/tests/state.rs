//! Buffer mutations compiled to a `.pte`: the state persists across
//! executes of one loaded method, starts from the buffer's value in the
//! file, and `reset_state` restores it; methods of one program share it by
//! name; on the GPU it stays resident (the decoders with a KV cache are in
//! the parity suite).

use std::sync::Arc;

use etmetal::compile::{compile_cpu, compile_methods, Backend, CompileOptions};
use etmetal::Model;
use etmetal_core::{BinaryOp, DType, Op, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind};
use etmetal_metal_runtime::{DeviceChoice, GpuStats, MetalBackend};
use etmetal_pte::Instruction;
use etmetal_runtime::LoadOptions;

mod common;

/// The accumulator (`acc += x; return acc * 2`) with `acc` starting at `[1, 2]`.
fn accumulator() -> Graph {
    common::graphs::accumulator(Tensor::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap())
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

/// `forward` and `again` (the same graph) in one program, for `backend`.
fn two_methods(backend: Backend) -> etmetal::compile::Compiled {
    let g = accumulator();
    let options = CompileOptions {
        backend,
        ..CompileOptions::default()
    };
    compile_methods(&[("forward", &g), ("again", &g)], &options, &mut |_| {}).unwrap()
}

/// The outputs of `calls` (method, x) on a fresh model, with a reset after
/// the first half; and the GPU counters after each call when `gpu` is given.
fn run_calls(
    pte: &[u8],
    gpu: Option<Arc<MetalBackend>>,
    calls: &[(&str, [f32; 2])],
) -> (Vec<Vec<f64>>, Vec<GpuStats>) {
    let mut options = LoadOptions::default();
    if let Some(g) = &gpu {
        options.backends.register(g.clone()).unwrap();
    }
    let mut model = Model::from_pte_bytes(pte, options).unwrap();
    let (mut outs, mut stats) = (vec![], vec![]);
    for (k, (method, x)) in calls.iter().enumerate() {
        if k == calls.len() / 2 {
            model.reset_state().unwrap();
        }
        let x = Tensor::from_f32(DType::F32, &[2], x).unwrap();
        outs.push(model.execute_method(method, vec![x]).unwrap()[0].to_f64_vec());
        stats.extend(gpu.as_ref().map(|g| g.stats()));
    }
    (outs, stats)
}

#[test]
fn methods_share_state_by_name() {
    let compiled = two_methods(Backend::Cpu);
    let file = etmetal_pte::parse(&compiled.pte).unwrap();
    // as share_mutable_buffers=True: planned memory 2, named, one initial value
    assert_eq!(file.program.execution_plan.len(), 2);
    for plan in &file.program.execution_plan {
        assert_eq!(plan.non_const_buffer_sizes.len(), 3, "{}", plan.name);
        let state: Vec<_> = plan
            .values
            .iter()
            .filter_map(|v| match v {
                etmetal_pte::EValue::Tensor(t)
                    if t.data_buffer_idx > 0 && t.allocation_info.is_some() =>
                {
                    Some(t)
                }
                _ => None,
            })
            .collect();
        assert_eq!(state.len(), 1, "{}", plan.name);
        assert_eq!(state[0].allocation_info.as_ref().unwrap().memory_id, 2);
        assert_eq!(
            state[0]
                .extra_tensor_info
                .as_ref()
                .unwrap()
                .fully_qualified_name,
            "acc"
        );
    }
    // offset 0 is ExecuTorch's placeholder, then the one shared value
    assert_eq!(file.program.mutable_data_segments[0].offsets.len(), 2);
    let calls = [
        ("forward", [10.0, 20.0]),
        ("again", [1.0, 1.0]),
        ("again", [1.0, 1.0]),
        ("forward", [10.0, 20.0]),
    ];
    // one method run alone: each call sees the state the previous one left
    let program = etmetal_runtime::Program::from_bytes(&compiled.pte).unwrap();
    let mut alone = program.method("forward").unwrap();
    let mut expected = vec![];
    for (_, x) in &calls[..2] {
        let x = Tensor::from_f32(DType::F32, &[2], x).unwrap();
        expected.push(alone.execute(vec![x]).unwrap()[0].to_f64_vec());
    }
    let (outs, _) = run_calls(&compiled.pte, None, &calls);
    assert_eq!(outs[..2], expected[..]);
    // after the reset, `again` starts from the initial value as forward did
    let first_again = run_calls(
        &compiled.pte,
        None,
        &[("again", [1.0, 1.0]), ("forward", [0.0, 0.0])],
    )
    .0;
    assert_eq!(outs[2], first_again[0]);
}

/// `return acc * 2 + y`: a method that only reads the buffer `acc` (as
/// `accumulator` does, starting at `init`).
fn reader(init: Tensor) -> Graph {
    let mut g = Graph::default();
    let acc = g.add_constant("b_acc", init);
    g.inputs.push((
        acc,
        InputKind::Buffer {
            fqn: "acc".into(),
            persistent: true,
        },
    ));
    let y = g.add_value("y", DType::F32, vec![2]);
    g.inputs.push((y, InputKind::User));
    let two = g.add_constant("two", Tensor::from_f32(DType::F32, &[], &[2.0]).unwrap());
    let (twice, out) = (
        g.add_value("twice", DType::F32, vec![2]),
        g.add_value("out", DType::F32, vec![2]),
    );
    for (name, op, a, b, o) in [
        ("mul", BinaryOp::Mul, acc, two, twice),
        ("add", BinaryOp::Add, twice, y, out),
    ] {
        g.nodes.push(Node {
            name: name.into(),
            target: "test".into(),
            op: Op::Binary(op),
            inputs: vec![Some(a), Some(b)],
            outputs: vec![o],
        });
    }
    g.outputs.push((out, OutputKind::User));
    g
}

/// A method that only reads a buffer another method writes sees what that
/// method wrote (not the initial value), on both backends; a reset gives
/// it the initial value again.
#[test]
fn a_method_reading_a_buffer_sees_what_another_wrote() {
    let init = Tensor::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap();
    let (write, read) = (accumulator(), reader(init));
    for backend in [Backend::Cpu, Backend::Metal] {
        let options = CompileOptions {
            backend,
            ..CompileOptions::default()
        };
        let compiled =
            compile_methods(&[("write", &write), ("read", &read)], &options, &mut |_| {}).unwrap();
        let gpu =
            (backend == Backend::Metal).then(|| Arc::new(MetalBackend::new(DeviceChoice::Auto)));
        let calls = [
            ("write", [10.0, 20.0]),
            ("read", [0.5, 0.5]),
            ("read", [0.0, 0.0]),
            ("write", [1.0, 1.0]),
        ];
        // acc = [1, 2], [11, 22] after the write; a reset before the third call
        let (outs, _) = run_calls(&compiled.pte, gpu, &calls);
        assert_eq!(outs[1], [22.5, 44.5], "{backend:?}");
        assert_eq!(outs[2], [2.0, 4.0], "{backend:?}");
        assert_eq!(outs[3], [4.0, 6.0], "{backend:?}");
    }
}

/// [`Model::execute_method_borrowed`] of `x`: the first output's values.
fn borrowed(model: &mut Model, method: &str, x: &Tensor) -> Vec<f64> {
    let mut out = vec![];
    model
        .execute_method_borrowed(method, &[etmetal_core::View::of(x)], &mut |i, v| {
            if i == 0 {
                out = Tensor::from_bytes(v.dtype, v.shape, v.bytes)?.to_f64_vec();
            }
            Ok(())
        })
        .unwrap();
    out
}

#[test]
fn borrowed_executes_share_state_as_owned_ones_do() {
    // a .pte of two methods: the calls of `methods_share_state_by_name`
    let compiled = two_methods(Backend::Cpu);
    let calls = [
        ("forward", [10.0, 20.0]),
        ("again", [1.0, 1.0]),
        ("again", [1.0, 1.0]),
        ("forward", [10.0, 20.0]),
    ];
    let (owned, _) = run_calls(&compiled.pte, None, &calls);
    let mut model = Model::from_pte_bytes(&compiled.pte, LoadOptions::default()).unwrap();
    for (k, (method, x)) in calls.iter().enumerate() {
        if k == calls.len() / 2 {
            model.reset_state().unwrap();
        }
        let x = Tensor::from_f32(DType::F32, &[2], x).unwrap();
        assert_eq!(borrowed(&mut model, method, &x), owned[k], "call {k}");
    }
    // a .pt2 interpreted on the CPU: the fixture's two calls
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let read = |f: &str| etmetal_core::npy::read(&dir.join(f)).unwrap();
    let mut model = Model::load(&dir.join("inplace_state.pt2")).unwrap();
    let inputs = [
        read("inplace_state.input_0.npy"),
        read("inplace_state.input_1.npy"),
    ];
    let views: Vec<_> = inputs.iter().map(etmetal_core::View::of).collect();
    for want in [
        "inplace_state.output_0.npy",
        "inplace_state.call2.output_0.npy",
    ] {
        let mut got = vec![];
        model
            .execute_method_borrowed("forward", &views, &mut |i, v| {
                if i == 0 {
                    got = Tensor::from_bytes(v.dtype, v.shape, v.bytes)?.to_f64_vec();
                }
                Ok(())
            })
            .unwrap();
        let want = read(want).to_f64_vec();
        assert_eq!(got.len(), want.len(), "{want:?}");
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 + 1e-5 * b.abs(), "{a} vs {b}");
        }
    }
}

#[test]
fn gpu_keeps_state_resident_and_matches_the_cpu() {
    let gpu = two_methods(Backend::Metal);
    for m in &gpu.methods {
        assert_eq!(m.resident_state, ["acc"], "{}", m.name);
    }
    let file = etmetal_pte::parse(&gpu.pte).unwrap();
    for plan in &file.program.execution_plan {
        // no write-back copy_: the delegate updates the state itself
        assert!(
            plan.operators.iter().all(|o| o.name != "aten::copy_"),
            "{}: {:?}",
            plan.name,
            plan.operators
        );
    }
    let calls = [
        ("forward", [10.0, 20.0]),
        ("forward", [1.0, 2.0]),
        ("forward", [3.0, -4.0]),
        ("again", [5.0, 6.0]),
        ("forward", [10.0, 20.0]),
        ("forward", [1.0, 2.0]),
        ("forward", [3.0, -4.0]),
        ("again", [5.0, 6.0]),
    ];
    let (want, _) = run_calls(&two_methods(Backend::Cpu).pte, None, &calls);
    let backend = Arc::new(MetalBackend::new(DeviceChoice::Auto));
    let (got, stats) = run_calls(&gpu.pte, Some(backend), &calls);
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        for (a, b) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "call {k}: {g:?} vs {w:?}"
            );
        }
    }
    // bytes per call: x and y are 8 bytes each, so is the state
    let delta = |k: usize, f: fn(&GpuStats) -> u64| f(&stats[k]) - f(&stats[k - 1]);
    let up = |k| delta(k, |s| s.bytes_uploaded);
    let back = |k| delta(k, |s| s.bytes_read_back);
    assert_eq!(
        stats[0].bytes_uploaded, 16,
        "first call: x and the initial state"
    );
    assert_eq!(stats[0].bytes_read_back, 8, "first call: y only");
    for k in [1, 2, 5, 6] {
        assert_eq!(
            (up(k), back(k)),
            (8, 8),
            "call {k}: the state stays on the GPU"
        );
    }
    // a switch reads forward's state back once and `again` uploads it
    assert_eq!((up(3), back(3)), (16, 16), "switch to `again`");
    // after reset_state the initial value is uploaded again
    assert_eq!((up(4), back(4)), (16, 8), "first call after the reset");
    assert_eq!(got[4], got[0]);
}

/// `x * scale` with `scale` a constant `[s, s]` of the same name in every method.
fn scaled(s: f32) -> Graph {
    let mut g = Graph::default();
    let x = g.add_value("x", DType::F32, vec![2]);
    g.inputs.push((x, InputKind::User));
    let scale = g.add_constant(
        "scale",
        Tensor::from_f32(DType::F32, &[2], &[s, s]).unwrap(),
    );
    let y = g.add_value("y", DType::F32, vec![2]);
    g.nodes.push(Node {
        name: "mul".into(),
        target: "test".into(),
        op: Op::Binary(BinaryOp::Mul),
        inputs: vec![Some(x), Some(scale)],
        outputs: vec![y],
    });
    g.outputs.push((y, OutputKind::User));
    g
}

#[test]
fn methods_keep_same_named_weights_apart_when_their_bytes_differ() {
    // as a decoder's prefill and decode lift `positions` constants of their
    // own lengths under one name
    let (double, triple) = (scaled(2.0), scaled(3.0));
    let compiled = compile_methods(
        &[("forward", &double), ("again", &triple), ("twice", &double)],
        &CompileOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    let file = etmetal_pte::parse(&compiled.pte).unwrap();
    let mut keys: Vec<&str> = file
        .program
        .named_data
        .iter()
        .map(|n| n.key.as_str())
        .collect();
    keys.sort();
    // the same bytes under the same name are stored once
    assert_eq!(keys, ["scale", "scale@again"]);
    let backend = Arc::new(MetalBackend::new(DeviceChoice::Auto));
    let mut options = LoadOptions::default();
    options.backends.register(backend).unwrap();
    let mut model = Model::from_pte_bytes(&compiled.pte, options).unwrap();
    for (method, want) in [("forward", 2.0), ("again", 3.0), ("twice", 2.0)] {
        let x = Tensor::from_f32(DType::F32, &[2], &[1.0, -4.0]).unwrap();
        let got = model.execute_method(method, vec![x]).unwrap()[0].to_f64_vec();
        assert_eq!(got, [want, -4.0 * want], "{method}");
    }
}

/// The in-place fixture (scripts/make_fixtures.py: a `.pt2` saved straight
/// from `torch.export.export`, with `relu_`, `index_copy_`, slice
/// assignment and a write through a `select` view into its buffers) imports
/// with both buffers as mutations, and its `.pte` for either backend gives
/// eager PyTorch's outputs for two calls, then again after a reset.
#[test]
fn in_place_export_keeps_its_buffers_as_state_on_both_backends() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let graph = etmetal_graph::load_pt2(&dir.join("inplace_state.pt2")).unwrap();
    let mutated: Vec<&OutputKind> = graph.outputs.iter().map(|(_, k)| k).collect();
    assert_eq!(
        mutated,
        [
            &OutputKind::BufferMutation {
                fqn: "cache".into()
            },
            &OutputKind::BufferMutation {
                fqn: "count".into()
            },
            &OutputKind::User
        ]
    );
    let npy = |f: &str| etmetal_core::npy::read(&dir.join(f)).unwrap();
    let inputs = vec![
        npy("inplace_state.input_0.npy"),
        npy("inplace_state.input_1.npy"),
    ];
    let want: Vec<Vec<f64>> = ["output_0", "call2.output_0"]
        .iter()
        .map(|o| npy(&format!("inplace_state.{o}.npy")).to_f64_vec())
        .collect();
    calls_reset_calls(&graph, &inputs, &want, None);
}

/// State held outside a module's attributes (scripts/make_fixtures.py's
/// LiftedState, exported non-strict, as transformers' caches are): the
/// lifted constants the graph writes are state, one of them under the name
/// of the buffer it is; both stay on the GPU, and two calls, a reset and
/// two more give eager PyTorch's outputs on either backend.
#[test]
fn lifted_constants_written_in_place_stay_on_the_gpu_as_state() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let graph = etmetal_graph::load_pt2(&dir.join("lifted_state.pt2")).unwrap();
    let npy = |f: &str| etmetal_core::npy::read(&dir.join(f)).unwrap();
    let inputs = vec![npy("lifted_state.input_0.npy")];
    let want: Vec<Vec<f64>> = ["output_0", "call2.output_0"]
        .iter()
        .map(|o| npy(&format!("lifted_state.{o}.npy")).to_f64_vec())
        .collect();
    calls_reset_calls(&graph, &inputs, &want, Some(&["state", "lifted_tensor_0"]));
}

/// Two methods that hold a state buffer differently (as a prefill and a
/// decode step exported with different caches would) are refused naming
/// the buffer, both methods and what differs.
#[test]
fn methods_holding_a_state_differently_are_refused_naming_it() {
    let wide = common::graphs::accumulator(Tensor::from_f32(DType::F32, &[3], &[0.0; 3]).unwrap());
    let other_start =
        common::graphs::accumulator(Tensor::from_f32(DType::F32, &[2], &[1.0, 5.0]).unwrap());
    for (g, want) in [
        (
            &wide,
            "state buffer `acc` is float32 [3] in method `prefill` but float32 [2] in method `forward`",
        ),
        (
            &other_start,
            "state buffer `acc` starts from other values in method `prefill` than in method \
             `forward` (element 1: 5 in `prefill`, 2 in `forward`)",
        ),
    ] {
        for backend in [Backend::Cpu, Backend::Metal] {
            let options = CompileOptions {
                backend,
                ..CompileOptions::default()
            };
            let first = accumulator();
            let e = compile_methods(&[("forward", &first), ("prefill", g)], &options, &mut |_| {})
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{backend:?}: {e}");
            assert!(e.contains("the same batch size, cache length"), "{e}");
        }
    }
}

/// On either backend, `graph`'s outputs over calls with `inputs` are
/// `want`'s (one per call), and again after a state reset; on the GPU the
/// buffers kept there as state are `resident`, where given.
fn calls_reset_calls(
    graph: &Graph,
    inputs: &[Tensor],
    want: &[Vec<f64>],
    resident: Option<&[&str]>,
) {
    for backend in [Backend::Cpu, Backend::Metal] {
        let options = CompileOptions {
            backend,
            ..CompileOptions::default()
        };
        let compiled = compile_methods(&[("forward", graph)], &options, &mut |_| {}).unwrap();
        let mut load = LoadOptions::default();
        if backend == Backend::Metal {
            if let Some(resident) = resident {
                assert_eq!(compiled.methods[0].resident_state, resident);
            }
            let gpu = Arc::new(MetalBackend::new(DeviceChoice::Auto));
            load.backends.register(gpu).unwrap();
        }
        let mut model = Model::from_pte_bytes(&compiled.pte, load).unwrap();
        for round in 0..2 {
            for (call, w) in want.iter().enumerate() {
                let got = model.execute(inputs.to_vec()).unwrap()[0].to_f64_vec();
                for (a, b) in got.iter().zip(w) {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                        "{backend:?} round {round} call {}: {got:?} vs {w:?}",
                        call + 1
                    );
                }
            }
            model.reset_state().unwrap();
        }
    }
}
