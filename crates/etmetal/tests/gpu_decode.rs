//! A Llama-style decode step on the GPU (tests/fixtures/decode/, made by
//! scripts/make_decode_fixture.py: the parity suite's KV-cache decoder with
//! 1 and 2 layers, one token at position 5): what a decoder layer costs in
//! dispatches, with its norms, rotary embeddings, cache writes, gate and
//! residual adds fused into the products and attention, and that the fused
//! step's logits match the CPU kernels' in f32 and bf16.

mod common;

use common::gpu::{assert_close, compile_whole, run_pte};
use etmetal::compile::{compile, CompileOptions};
use etmetal_core::{DType, Tensor};
use etmetal_graph::Graph;

/// Dispatches a decoder layer's step may take (issue 18's goal): q, k and
/// v (2: one kernel's 8 bindings hold two beside the norm's reads; each
/// computes the RMSNorm's mean of squares itself and reads its scaling),
/// the new key and value caches (2: each a partition output written once,
/// which attention reads), attention computing the rotary q and the causal
/// mask as it reads them (1), o and down with their residual adds in the
/// store (2), gate and up as one (1; with the second norm; the SiLU gate
/// is read by down). Before these fusions: 29.
const LAYER_DISPATCHES: usize = 8;

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
