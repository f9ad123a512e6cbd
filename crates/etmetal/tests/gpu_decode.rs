//! A Llama-style decode step on the GPU (tests/fixtures/decode/, made by
//! scripts/make_decode_fixture.py: the parity suite's KV-cache decoder with
//! 1 and 2 layers, one token at position 5): what a decoder layer costs in
//! dispatches, with its norms, rotary embeddings, cache writes, gate and
//! residual adds fused into the products and attention, and that the fused
//! step's logits match the CPU kernels' in f32 and bf16. Then the
//! transformers recipe's decode step (tests/fixtures/llm/), whose KV-cache
//! writes (`index_copy_`) are written in place on the GPU, those writes
//! against the CPU kernels, and the attention that makes them itself over
//! several steps.

mod common;

use common::gpu::{assert_close, backend, compile_whole, load_method, random, run_pte};
use etmetal::compile::{compile, compile_cpu, CompileOptions};
use etmetal::Model;
use etmetal_core::{BinaryOp, DType, Op, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_runtime::LoadOptions;

/// Dispatches a decoder layer's step may take: q, k and v as one product
/// of concatenated weights (1; computing the RMSNorm's mean of squares
/// itself and reading its scaling), attention computing the rotary q and
/// the causal mask as it reads them and writing the step's key and value
/// rows into the caches first (1), o and down with their residual adds in
/// the store (2), gate and up as one (1; with the second norm; the SiLU
/// gate in gate's store, read by down). Before these fusions: 29; then 8
/// (q, k and v two kernels for the bindings, each new cache its own).
const LAYER_DISPATCHES: usize = 5;

fn decoder(layers: usize, dtype: DType) -> Graph {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../tests/fixtures/decode/llama_{layers}.pt2"));
    let mut graph = etmetal_graph::load_pt2(&path).unwrap();
    etmetal_graph::precision::convert_floats(&mut graph, dtype).unwrap();
    graph
}

/// Dispatches of the step with `layers` layers; every node on the GPU.
fn dispatches(layers: usize, dtype: DType) -> usize {
    let compiled = compile(
        &decoder(layers, dtype),
        &CompileOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    let method = &compiled.methods[0];
    assert!(method.cpu_nodes.is_empty(), "{:?}", method.cpu_nodes);
    assert_eq!(method.partitions.len(), 1, "{layers} layers, {dtype}");
    method.partitions[0].payload.dispatches.len()
}

#[test]
fn a_decoder_layer_takes_few_dispatches() {
    for dtype in [DType::F32, DType::BF16] {
        let layer = dispatches(2, dtype) - dispatches(1, dtype);
        assert!(
            layer <= LAYER_DISPATCHES,
            "{dtype}: {layer} dispatches a layer, more than {LAYER_DISPATCHES}"
        );
    }
}

#[test]
fn fused_decode_step_matches_the_cpu_kernels() {
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2)] {
        let inputs = vec![
            Tensor::from_i64(DType::I64, &[1, 1], &[3]).unwrap(),
            Tensor::from_i64(DType::I64, &[1], &[5]).unwrap(),
        ];
        let what = format!("2-layer decode step, {dtype}");
        let graph = decoder(2, dtype);
        // the CPU's outputs: the new caches, then the logits (which read
        // the row just written at position 5)
        let expected = etmetal::eval::run_graph(&graph, inputs.clone()).unwrap();
        let got = run_pte(compile_whole(&graph), inputs);
        assert_eq!(got.len(), 1, "{what}: the logits only (the caches stay)");
        assert_close(&got[0], expected.last().unwrap(), tol, &what);
    }
}

/// The same step with every linear in int4 (groups of 32, the decoder's
/// widths are 32 and 64): the int4 matrix-vector kernels of each layer and
/// the head match the CPU kernels on the quantized graph.
#[test]
fn int4_decode_step_matches_the_cpu_kernels() {
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2)] {
        let inputs = vec![
            Tensor::from_i64(DType::I64, &[1, 1], &[3]).unwrap(),
            Tensor::from_i64(DType::I64, &[1], &[5]).unwrap(),
        ];
        let what = format!("int4 2-layer decode step, {dtype}");
        let mut graph = decoder(2, dtype);
        let report = etmetal_graph::quantize::quantize_int4(&mut graph, 32, &[]).unwrap();
        assert!(report.skipped.is_empty(), "{what}: {:?}", report.skipped);
        assert!(
            graph
                .nodes
                .iter()
                .any(|n| matches!(n.op, etmetal_core::Op::Int4Linear { .. })),
            "{what}: nothing quantized"
        );
        let expected = etmetal::eval::run_graph(&graph, inputs.clone()).unwrap();
        let got = run_pte(compile_whole(&graph), inputs);
        assert_close(&got[0], expected.last().unwrap(), tol, &what);
    }
}

/// Decode steps of the 2-layer decoder, its linears in float and in int4
/// (q, k and v one product either way, so attention binds few enough
/// buffers to write the step's key and value rows into the caches itself,
/// no dispatch of their own): each step's logits read the rows every step
/// before wrote, and match the CPU kernels' at each of 6 positions, in
/// f32 and bf16.
#[test]
fn attention_writes_the_cache_rows_later_steps_read() {
    let cases = [(DType::F32, 1e-4), (DType::BF16, 2e-2)];
    for ((dtype, tol), int4) in cases.iter().flat_map(|&c| [(c, false), (c, true)]) {
        let mut graph = decoder(2, dtype);
        if int4 {
            etmetal_graph::quantize::quantize_int4(&mut graph, 32, &[]).unwrap();
        }
        let dtype = format!("{dtype}{}", if int4 { " int4" } else { "" });
        let gpu = compile(&graph, &CompileOptions::default(), &mut |_| {}).unwrap();
        let payload = &gpu.methods[0].partitions[0].payload;
        let ops: Vec<&str> = (payload.dispatches.iter())
            .map(|d| payload.kernels[d.kernel].ops[0].as_str())
            .collect();
        assert!(
            !ops.contains(&"index_copy"),
            "{dtype}: the cache rows have a dispatch of their own: {ops:?}"
        );
        let mut options = LoadOptions::default();
        options.backends.register(backend()).unwrap();
        let mut on_gpu = Model::from_pte_bytes(&gpu.pte, options).unwrap();
        let cpu = compile_cpu(&graph).unwrap();
        let mut on_cpu = Model::from_pte_bytes(&cpu, LoadOptions::default()).unwrap();
        for (pos, token) in [(0, 3), (1, 17), (2, 5), (3, 60), (4, 1), (5, 33)] {
            let inputs = vec![
                Tensor::from_i64(DType::I64, &[1, 1], &[token]).unwrap(),
                Tensor::from_i64(DType::I64, &[1], &[pos]).unwrap(),
            ];
            let want = on_cpu.execute_method("forward", inputs.clone()).unwrap();
            let got = on_gpu.execute_method("forward", inputs).unwrap();
            assert_close(&got[0], &want[0], tol, &format!("{dtype} step at {pos}"));
        }
    }
}

/// `sdpa(q, k_cache.index_copy_(2, pos, k), v_cache.index_copy_(2, pos,
/// v), mask)` with GQA (4 query heads on 2 KV heads) and 3 new rows a step
/// into caches of 300 positions kept on the GPU: attention writes the rows
/// itself (no dispatch of their own), rows on both sides of its key
/// split's boundary (256) and a row written over, and later steps read
/// what earlier ones wrote, as the CPU kernels do.
#[test]
fn attention_writes_several_rows_across_its_key_splits() {
    let (heads, kv, s, d, l) = (4, 2, 300, 16, 3);
    for dtype in [DType::F32, DType::BF16] {
        let mut g = Graph::default();
        let cache = |g: &mut Graph, name: &str, seed| {
            let c = g.add_constant(format!("b_{name}"), random(dtype, &[1, kv, s, d], seed));
            let fqn = name.to_string();
            g.inputs.push((
                c,
                InputKind::Buffer {
                    fqn,
                    persistent: true,
                },
            ));
            c
        };
        let (kc, vc) = (cache(&mut g, "k_cache", 1), cache(&mut g, "v_cache", 2));
        let pos = value(&mut g, "pos", DType::I64, &[l]);
        let q = value(&mut g, "q", dtype, &[1, heads, l, d]);
        let k = value(&mut g, "k", dtype, &[1, kv, l, d]);
        let v = value(&mut g, "v", dtype, &[1, kv, l, d]);
        let mask = value(&mut g, "mask", DType::Bool, &[l, s]);
        let copy = Op::IndexCopy { dim: 2 };
        let nk = push(&mut g, copy.clone(), &[kc, pos, k], &[1, kv, s, d], dtype);
        let nv = push(&mut g, copy, &[vc, pos, v], &[1, kv, s, d], dtype);
        let sdpa = Op::Sdpa {
            is_causal: false,
            scale: None,
            enable_gqa: true,
        };
        let y = push(&mut g, sdpa, &[q, nk, nv, mask], &[1, heads, l, d], dtype);
        for (v, fqn) in [(nk, "k_cache"), (nv, "v_cache")] {
            let fqn = fqn.to_string();
            g.outputs.push((v, OutputKind::BufferMutation { fqn }));
        }
        g.outputs.push((y, OutputKind::User));
        let gpu = compile(&g, &CompileOptions::default(), &mut |_| {}).unwrap();
        let payload = &gpu.methods[0].partitions[0].payload;
        let ops: Vec<&str> = (payload.dispatches.iter())
            .map(|d| payload.kernels[d.kernel].ops[0].as_str())
            .collect();
        assert!(!ops.contains(&"index_copy"), "{dtype}: {ops:?}");
        assert!(ops.len() >= 2, "{dtype}: the keys split: {ops:?}");
        let mut on_gpu = load_method(&gpu.pte);
        let cpu = etmetal_runtime::Program::from_bytes(&compile_cpu(&g).unwrap()).unwrap();
        let mut on_cpu = cpu.method("forward").unwrap();
        for (step, at) in [[254, 255, 256], [257, 0, 299], [1, 2, 3]]
            .into_iter()
            .enumerate()
        {
            // each row sees the keys up to the latest position written
            let last = at.iter().max().copied().unwrap_or(0);
            let keep: Vec<i64> = (0..l * s)
                .map(|i| i64::from((i % s) as i64 <= last))
                .collect();
            let seed = 10 * step as u64;
            let inputs = vec![
                Tensor::from_i64(DType::I64, &[l], &at).unwrap(),
                random(dtype, &[1, heads, l, d], seed + 3),
                random(dtype, &[1, kv, l, d], seed + 4),
                random(dtype, &[1, kv, l, d], seed + 5),
                Tensor::from_i64(DType::Bool, &[l, s], &keep).unwrap(),
            ];
            let got = on_gpu.execute(inputs.clone()).unwrap();
            let want = on_cpu.execute(inputs).unwrap();
            let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-5 };
            assert_close(
                &got[0],
                &want[0],
                tol,
                &format!("{dtype} step {step} at {at:?}"),
            );
        }
    }
}

/// Dispatches of the last layer (from its q projection, which reads its
/// input norm's weight, to the final norm's) of the transformers recipe's
/// Llama decode step (tests/fixtures/llm/decode.pt2, made by
/// scripts/make_llm_fixture.py: 2 layers, a static KV cache kept on the
/// GPU; the first layer also makes the rotary table and reads the
/// embedding): q, k and v as one product with the norm (1), attention
/// writing the rotary key row and the value row into their caches in
/// place and reading the rotary q and the mask as it goes (1), o (1), gate
/// and up with the norm (1), down with the SiLU gate (1). Before: 9 in
/// f32, 11 in bf16 (each cache rewritten whole by a `where`, the rotary q
/// and the position's add each a kernel; in bf16 the rotary tables'
/// rounding too), then 6 (the cache rows one kernel of their own).
const RECIPE_LAYER_DISPATCHES: usize = 5;
/// The same with every linear in int4 (q, k and v one int4 product of
/// concatenated weights, as gate and up; the norms' means and scaling, the
/// residual adds and the SiLU gate in the products). Before: 19, then 6.
const RECIPE_INT4_LAYER_DISPATCHES: usize = 5;

#[test]
fn recipe_decode_layer_takes_five_dispatches_and_writes_its_caches_in_place() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/llm/decode.pt2");
    let cases = [
        (DType::F32, false, RECIPE_LAYER_DISPATCHES),
        (DType::BF16, false, RECIPE_LAYER_DISPATCHES),
        (DType::F32, true, RECIPE_INT4_LAYER_DISPATCHES),
    ];
    for (dtype, int4, budget) in cases {
        let mut graph = etmetal_graph::load_pt2(&path).unwrap();
        etmetal_graph::precision::convert_floats(&mut graph, dtype).unwrap();
        if int4 {
            etmetal_graph::quantize::quantize_int4(&mut graph, 32, &[]).unwrap();
        }
        let dtype = format!("{dtype}{}", if int4 { " int4" } else { "" });
        let compiled = compile(&graph, &CompileOptions::default(), &mut |_| {}).unwrap();
        let method = &compiled.methods[0];
        assert!(
            method.cpu_nodes.is_empty(),
            "{dtype}: {:?}",
            method.cpu_nodes
        );
        assert_eq!(method.resident_state.len(), 4, "{dtype}: the 4 caches");
        let payload = &method.partitions[0].payload;
        let first = |weight: &str| {
            payload
                .dispatches
                .iter()
                .position(|d| {
                    d.buffers
                        .iter()
                        .any(|&b| payload.buffers[b].name.contains(weight))
                })
                .unwrap_or_else(|| panic!("{dtype}: no dispatch reads {weight}"))
        };
        let layer = first("model_norm_weight") - first("layers_1_input_layernorm_weight");
        assert!(
            layer <= budget,
            "{dtype}: {layer} dispatches a layer, more than {budget}"
        );
        // each cache's new value is its own buffer: nothing copied back
        for st in &payload.state {
            assert_eq!(
                st.new_value, payload.inputs[st.input],
                "{dtype}: {}",
                st.fqn
            );
        }
    }
}

/// A new user input of `g`.
fn value(g: &mut Graph, name: &str, dtype: DType, shape: &[usize]) -> ValueId {
    let v = g.add_value(name, dtype, shape.to_vec());
    g.inputs.push((v, InputKind::User));
    v
}

/// A new node of `g` computing `op`, its output of `shape` and `dtype`.
fn push(g: &mut Graph, op: Op, inputs: &[ValueId], shape: &[usize], dtype: DType) -> ValueId {
    let name = format!("n{}", g.nodes.len());
    let out = g.add_value(format!("{name}.out"), dtype, shape.to_vec());
    g.nodes.push(Node {
        name,
        target: "test".into(),
        op,
        inputs: inputs.iter().map(|&v| Some(v)).collect(),
        outputs: vec![out],
    });
    out
}

/// `cache.index_copy_(dim, pos, row); return cache * 2`, with `cache` a
/// buffer of `dtype` and `shape` (8 positions along `dim`).
fn cache_writer(dtype: DType, shape: [usize; 4], dim: usize) -> Graph {
    let mut row_shape = shape;
    row_shape[dim] = 1;
    let mut g = Graph::default();
    let cache = g.add_constant("b_cache", random(dtype, &shape, 9));
    g.inputs.push((
        cache,
        InputKind::Buffer {
            fqn: "cache".into(),
            persistent: true,
        },
    ));
    let pos = value(&mut g, "pos", DType::I64, &[1]);
    let row = value(&mut g, "row", dtype, &row_shape);
    let two = g.add_constant("two", Tensor::from_f32(dtype, &[], &[2.0]).unwrap());
    let new = push(
        &mut g,
        Op::IndexCopy { dim },
        &[cache, pos, row],
        &shape,
        dtype,
    );
    let y = push(
        &mut g,
        Op::Binary(BinaryOp::Mul),
        &[new, two],
        &shape,
        dtype,
    );
    g.outputs.push((
        new,
        OutputKind::BufferMutation {
            fqn: "cache".into(),
        },
    ));
    g.outputs.push((y, OutputKind::User));
    g
}

/// Steps writing a resident cache at positions 0, the last slot, 3 and the
/// last again: the GPU's in-place write of the new row matches the CPU
/// kernels' (the portable decomposition) exactly at every step, and the
/// cache is written in place. Positions along dim 2 of `[1, 2, 8, 4]`
/// (transformers' layout) and along dim 1 of `[2, 8, 2, 4]` (rows of
/// several dims, several before them).
#[test]
fn index_copy_into_a_resident_cache_matches_the_cpu_at_every_position() {
    let layouts = [([1, 2, 8, 4], 2), ([2, 8, 2, 4], 1)];
    for (dtype, (shape, dim)) in [DType::F32, DType::BF16]
        .into_iter()
        .flat_map(|d| layouts.map(|l| (d, l)))
    {
        let graph = cache_writer(dtype, shape, dim);
        let mut row_shape = shape;
        row_shape[dim] = 1;
        let gpu = compile(&graph, &CompileOptions::default(), &mut |_| {}).unwrap();
        let method = &gpu.methods[0];
        assert_eq!(method.resident_state, ["cache"], "{dtype}");
        let payload = &method.partitions[0].payload;
        let st = &payload.state[0];
        assert_eq!(st.new_value, payload.inputs[st.input], "{dtype}: in place");
        let mut on_gpu = load_method(&gpu.pte);
        let cpu = etmetal_runtime::Program::from_bytes(&compile_cpu(&graph).unwrap()).unwrap();
        let mut on_cpu = cpu.method("forward").unwrap();
        for (step, at) in [0, 7, 3, 7].into_iter().enumerate() {
            let inputs = vec![
                Tensor::from_i64(DType::I64, &[1], &[at]).unwrap(),
                random(dtype, &row_shape, step as u64 + 1),
            ];
            let got = on_gpu.execute(inputs.clone()).unwrap();
            let want = on_cpu.execute(inputs).unwrap();
            assert_close(
                &got[0],
                &want[0],
                0.0,
                &format!("{dtype} {shape:?} dim {dim}: step {step} at {at}"),
            );
        }
    }
}

/// Copies the GPU cannot write in place (the input is the caller's): two
/// rows along dim 0 (an expression per row), and six then five overlapping
/// rows along the last dim (odd rows: a copy, then written in place, the
/// second write over the first), in f32 and bf16.
#[test]
fn index_copy_of_user_inputs_matches_the_cpu() {
    for dtype in [DType::F32, DType::BF16] {
        let mut g = Graph::default();
        let x = value(&mut g, "x", dtype, &[4, 3]);
        let at = value(&mut g, "at", DType::I64, &[2]);
        let src = value(&mut g, "src", dtype, &[2, 3]);
        let y = push(
            &mut g,
            Op::IndexCopy { dim: 0 },
            &[x, at, src],
            &[4, 3],
            dtype,
        );
        g.outputs.push((y, OutputKind::User));
        let inputs = vec![
            random(dtype, &[4, 3], 1),
            Tensor::from_i64(DType::I64, &[2], &[3, 0]).unwrap(),
            random(dtype, &[2, 3], 2),
        ];
        common::gpu::check_graph(&g, inputs, 0.0, &format!("{dtype}: 2 rows of dim 0"));

        let mut g = Graph::default();
        let x = value(&mut g, "x", dtype, &[3, 9]);
        let a1 = value(&mut g, "a1", DType::I64, &[6]);
        let s1 = value(&mut g, "s1", dtype, &[3, 6]);
        let a2 = value(&mut g, "a2", DType::I64, &[5]);
        let s2 = value(&mut g, "s2", dtype, &[3, 5]);
        let y1 = push(
            &mut g,
            Op::IndexCopy { dim: 1 },
            &[x, a1, s1],
            &[3, 9],
            dtype,
        );
        let y2 = push(
            &mut g,
            Op::IndexCopy { dim: 1 },
            &[y1, a2, s2],
            &[3, 9],
            dtype,
        );
        g.outputs.push((y2, OutputKind::User));
        let inputs = vec![
            random(dtype, &[3, 9], 3),
            Tensor::from_i64(DType::I64, &[6], &[8, 0, 2, 4, 6, 1]).unwrap(),
            random(dtype, &[3, 6], 4),
            Tensor::from_i64(DType::I64, &[5], &[1, 2, 3, 7, 8]).unwrap(),
            random(dtype, &[3, 5], 5),
        ];
        common::gpu::check_graph(
            &g,
            inputs,
            0.0,
            &format!("{dtype}: 6 then 5 of the last dim"),
        );
    }
}
