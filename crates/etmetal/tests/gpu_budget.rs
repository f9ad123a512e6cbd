//! However many buffers an expression reads, no kernel binds more storage
//! buffers than wgpu's default limit (8 a shader stage, which every
//! adapter offers): a cat of 40 parts (DenseNet-169's dense blocks reach
//! 33) is written by several kernels, each its slice of the output; a sum
//! of 16 inputs fuses in pieces; a max with indices reads a sum of 7 from
//! a buffer. Each graph runs on a device capped at wgpu's default limits
//! and is compared with the CPU kernels.

mod common;

use common::gpu::{check_capped, compile_whole_within, random};
use etmetal_core::{BinaryOp, DType, Op, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::DeviceLimits;
use etmetal_metal::payload::Requirements;

/// Graph `g` with inputs `inputs`: one partition whose kernels each bind
/// at most wgpu's default storage buffers, and on a device offering no
/// more, the CPU kernels' results. Returns its dispatch count.
fn check_within_default_limits(g: &Graph, inputs: Vec<Tensor>, tol: f32, what: &str) -> usize {
    let budget = Requirements::default().max_storage_buffers_per_shader_stage;
    let expected = etmetal::eval::run_graph(g, inputs.clone())
        .unwrap_or_else(|e| panic!("{what}: CPU reference: {e}"));
    let compiled = compile_whole_within(g, &DeviceLimits::default());
    let parts = &compiled.methods[0].partitions;
    assert_eq!(parts.len(), 1, "{what}: not delegated whole");
    let payload = &parts[0].payload;
    for d in &payload.dispatches {
        let k = &payload.kernels[d.kernel];
        assert!(
            d.buffers.len() as u32 <= budget,
            "{what}: kernel `{}` binds {} storage buffers",
            k.name,
            d.buffers.len()
        );
    }
    let need = payload.requirements.max_storage_buffers_per_shader_stage;
    assert!(
        need <= budget,
        "{what}: the payload requires {need} bindings"
    );
    check_capped(
        Requirements::default(),
        &compiled.pte,
        inputs,
        &expected,
        tol,
        what,
    );
    payload.dispatches.len()
}

fn input(g: &mut Graph, inputs: &mut Vec<Tensor>, t: Tensor) -> ValueId {
    let v = g.add_value(format!("x{}", inputs.len()), t.dtype(), t.shape().to_vec());
    g.inputs.push((v, InputKind::User));
    inputs.push(t);
    v
}

/// A node of `op` over `args`: its outputs.
fn node_outputs(g: &mut Graph, op: Op, args: &[ValueId]) -> Vec<ValueId> {
    let mut node = Node {
        name: format!("n{}", g.nodes.len()),
        target: "test".into(),
        op,
        inputs: args.iter().map(|&v| Some(v)).collect(),
        outputs: vec![],
    };
    let outs = etmetal_graph::infer::infer(g, &node).unwrap_or_else(|e| panic!("infer: {e}"));
    for (k, (dtype, shape)) in outs.into_iter().enumerate() {
        let v = g.add_value(format!("{}_{k}", node.name), dtype, shape);
        node.outputs.push(v);
    }
    let outputs = node.outputs.clone();
    g.nodes.push(node);
    outputs
}

fn node(g: &mut Graph, op: Op, args: &[ValueId]) -> ValueId {
    node_outputs(g, op, args)[0]
}

fn tol(dtype: DType) -> f32 {
    if dtype == DType::F32 {
        0.0
    } else {
        1e-2
    }
}

/// 40 parts of sizes 1, 2, 3, … along each dim, in f32 and in 16-bit
/// floats (whose packed words a slice may end inside: odd runs), and 12
/// parts that are sums of two inputs each (parts reading 2 buffers).
#[test]
fn a_cat_of_many_parts_writes_its_slices_in_several_kernels() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for dim in 0..3 {
            let (mut g, mut inputs) = (Graph::default(), vec![]);
            let parts: Vec<ValueId> = (0..40)
                .map(|i| {
                    let mut shape = vec![2, 3, 3];
                    shape[dim] = 1 + i % 3;
                    input(&mut g, &mut inputs, random(dtype, &shape, i as u64 + 1))
                })
                .collect();
            let y = node(&mut g, Op::Cat { dim }, &parts);
            g.outputs.push((y, OutputKind::User));
            let what = format!("cat of 40 {} parts along dim {dim}", dtype.name());
            let dispatches = check_within_default_limits(&g, inputs, tol(dtype), &what);
            // 40 reads and the output: at least 6 kernels of 8 bindings
            assert!(dispatches >= 6, "{what}: {dispatches} dispatches");
        }
    }
    let (mut g, mut inputs) = (Graph::default(), vec![]);
    let parts: Vec<ValueId> = (0..12)
        .map(|i| {
            let a = input(&mut g, &mut inputs, random(DType::F32, &[2, 5], 2 * i));
            let b = input(&mut g, &mut inputs, random(DType::F32, &[2, 5], 2 * i + 1));
            node(&mut g, Op::Binary(BinaryOp::Add), &[a, b])
        })
        .collect();
    let y = node(&mut g, Op::Cat { dim: 1 }, &parts);
    g.outputs.push((y, OutputKind::User));
    check_within_default_limits(&g, inputs, 0.0, "cat of 12 sums");
}

/// A balanced sum of 16 inputs, and a `where` choosing between two sums
/// of 4 by a comparison of two more: each node fuses its inputs until a
/// kernel would bind more than the budget, then reads them from buffers.
#[test]
fn an_expression_of_many_leaves_fuses_in_pieces() {
    for dtype in [DType::F32, DType::BF16] {
        let (mut g, mut inputs) = (Graph::default(), vec![]);
        let mut level: Vec<ValueId> = (0..16)
            .map(|i| input(&mut g, &mut inputs, random(dtype, &[3, 5], 100 + i)))
            .collect();
        while level.len() > 1 {
            level = level
                .chunks(2)
                .map(|p| node(&mut g, Op::Binary(BinaryOp::Add), p))
                .collect();
        }
        g.outputs.push((level[0], OutputKind::User));
        let what = format!("sum of 16 {} inputs", dtype.name());
        check_within_default_limits(&g, inputs, tol(dtype), &what);

        let (mut g, mut inputs) = (Graph::default(), vec![]);
        let sum = |g: &mut Graph, inputs: &mut Vec<Tensor>, seed: u64| {
            let xs: Vec<ValueId> = (0..4)
                .map(|i| input(g, inputs, random(dtype, &[3, 5], seed + i)))
                .collect();
            let ab = node(g, Op::Binary(BinaryOp::Add), &xs[..2]);
            let cd = node(g, Op::Binary(BinaryOp::Mul), &xs[2..]);
            node(g, Op::Binary(BinaryOp::Sub), &[ab, cd])
        };
        let a = sum(&mut g, &mut inputs, 200);
        let b = sum(&mut g, &mut inputs, 300);
        let p = input(&mut g, &mut inputs, random(dtype, &[3, 5], 400));
        let q = input(&mut g, &mut inputs, random(dtype, &[3, 5], 401));
        let c = node(&mut g, Op::Binary(BinaryOp::Lt), &[p, q]);
        let y = node(&mut g, Op::Where, &[c, a, b]);
        g.outputs.push((y, OutputKind::User));
        let what = format!("where over sums of {}", dtype.name());
        check_within_default_limits(&g, inputs, tol(dtype), &what);
    }
}

/// max with indices (two outputs) of a sum of 7 inputs, which alone a
/// kernel could fuse (7 reads and its output): the reduction reads it from
/// a buffer instead of binding 7 reads and two outputs.
#[test]
fn a_reduction_with_two_outputs_reads_a_wide_sum_from_a_buffer() {
    let (mut g, mut inputs) = (Graph::default(), vec![]);
    let xs: Vec<ValueId> = (0..7)
        .map(|i| input(&mut g, &mut inputs, random(DType::F32, &[4, 9], 500 + i)))
        .collect();
    let add = |g: &mut Graph, a, b| node(g, Op::Binary(BinaryOp::Add), &[a, b]);
    let (a, b) = (add(&mut g, xs[0], xs[1]), add(&mut g, xs[2], xs[3]));
    let (c, d) = (add(&mut g, xs[4], xs[5]), add(&mut g, a, b));
    let e = add(&mut g, c, xs[6]);
    let sum = add(&mut g, d, e);
    let op = Op::ReduceWithIndices {
        max: true,
        dim: 1,
        keepdim: false,
    };
    for y in node_outputs(&mut g, op, &[sum]) {
        g.outputs.push((y, OutputKind::User));
    }
    check_within_default_limits(&g, inputs, 0.0, "max with indices of a sum of 7");
}
