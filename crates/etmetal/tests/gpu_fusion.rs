//! The decode-step fusions against the CPU kernels, on this machine's
//! adapter, at odd and even sizes in f32 and bf16: a matrix-vector product
//! computing an RMSNorm (its mean of squares in a prologue, its scaling as
//! the input read) or reading a SiLU gate, storing a residual add, several
//! products of one input in one dispatch; reductions over size-1 dims (one position's `index_copy_`)
//! fused into their readers; argmax over a vocabulary-sized last dim (the
//! greedy token); a convolution's batch norm, activation and residual add
//! in its store.

mod common;

use common::gpu::{
    check_graph, check_graph_emulating, compile_whole_within, emulations, random, OpCase,
};
use etmetal_core::{BinaryOp, DType, Op, ReduceOp, Tensor, UnaryOp};
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::DeviceLimits;
use etmetal_metal::preprocess::CoopForm;

const TOL: f32 = 1e-4;
const BF16_TOL: f32 = 2e-2;

/// A graph built node by node, inputs given as tensors.
#[derive(Default)]
struct Builder {
    graph: Graph,
    inputs: Vec<Tensor>,
    weights: usize,
}

impl Builder {
    fn input(&mut self, t: Tensor) -> ValueId {
        let name = format!("x{}", self.inputs.len());
        let v = self.graph.add_value(name, t.dtype(), t.shape().to_vec());
        self.graph.inputs.push((v, InputKind::User));
        self.inputs.push(t);
        v
    }

    fn weight(&mut self, t: Tensor) -> ValueId {
        self.weights += 1;
        let name = format!("w{}", self.weights);
        let v = self.graph.add_constant(name.clone(), t);
        self.graph
            .inputs
            .push((v, InputKind::Parameter { fqn: name }));
        v
    }

    fn node(&mut self, op: Op, inputs: &[Option<ValueId>]) -> ValueId {
        let mut node = Node {
            name: format!("n{}", self.graph.nodes.len()),
            target: "test".into(),
            op,
            inputs: inputs.to_vec(),
            outputs: vec![],
        };
        let (dtype, shape) = etmetal_graph::infer::infer(&self.graph, &node)
            .unwrap_or_else(|e| panic!("infer: {e}"))
            .remove(0);
        let v = self.graph.add_value(node.name.clone(), dtype, shape);
        node.outputs.push(v);
        self.graph.nodes.push(node);
        v
    }

    fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        self.node(Op::Binary(op), &[Some(a), Some(b)])
    }

    /// `rms_norm(x) · g` over the last of x's 3 dims (`k` wide), written
    /// out as a decoder does: mean of squares, rsqrt, two products.
    fn rms_norm(&mut self, x: ValueId, dtype: DType, k: usize, seed: u64) -> ValueId {
        let sq = self.binary(BinaryOp::Mul, x, x);
        let mean = Op::Reduce {
            op: ReduceOp::Mean,
            dims: vec![2],
            keepdim: true,
        };
        let ms = self.node(mean, &[Some(sq)]);
        let eps = self.weight(Tensor::scalar_f64(dtype, 1e-6).unwrap());
        let ms = self.binary(BinaryOp::Add, ms, eps);
        let r = self.node(Op::Unary(UnaryOp::Rsqrt), &[Some(ms)]);
        let h = self.binary(BinaryOp::Mul, x, r);
        let g = self.weight(random(dtype, &[k], seed));
        self.binary(BinaryOp::Mul, h, g)
    }

    /// GPU and CPU agree, every dispatch is a kernel of one of the ops
    /// `kernels` names (the others fused into them) or a copy packing a
    /// 16-bit output (products store f32 intermediates), the products
    /// take at most `products` dispatches, and every kernel fits wgpu's
    /// default 16 KiB of workgroup memory.
    fn check(
        mut self,
        outputs: &[ValueId],
        tol: f32,
        what: &str,
        kernels: &[&str],
        products: usize,
    ) {
        let packs = outputs
            .iter()
            .any(|&v| self.graph.value(v).dtype.size() == 2);
        for &v in outputs {
            self.graph.outputs.push((v, OutputKind::User));
        }
        let payload = &compile_whole_within(&self.graph, &DeviceLimits::default()).methods[0]
            .partitions[0]
            .payload;
        let linear = payload
            .dispatches
            .iter()
            .filter(|d| payload.kernels[d.kernel].ops[0] == "linear")
            .count();
        assert!(linear <= products, "{what}: {linear} product dispatches");
        let storage = payload.requirements.max_compute_workgroup_storage_size;
        assert!(
            storage <= 16384,
            "{what}: {storage} bytes of workgroup memory"
        );
        for d in &payload.dispatches {
            let k = &payload.kernels[d.kernel];
            let op = k.ops[0].as_str();
            assert!(
                kernels.contains(&op) || (packs && op == "copy"),
                "{what}: a dispatch of its own for {:?}",
                k.ops
            );
        }
        check_graph(&self.graph, self.inputs, tol, what);
    }
}

fn tol(dtype: DType) -> f32 {
    if dtype == DType::BF16 {
        BF16_TOL
    } else {
        TOL
    }
}

/// `x + linear(rms_norm(x) · g, w)` written out as a decoder does (mean of
/// squares, rsqrt, two products) beside two more products of the same
/// input: the products compute the mean of squares and read the scaling
/// as their input, store the residual adds, and share dispatches.
#[test]
fn rms_norm_into_a_product_with_a_residual_add() {
    for dtype in [DType::F32, DType::BF16] {
        for (m, k, n, seed) in [
            (1, 37, 19, 1),
            (3, 64, 64, 2),
            (8, 130, 33, 3),
            (1, 256, 514, 4),
            (1, 1024, 600, 5),
            // (columns enough for 16 chunks an invocation, 16 invocations
            // a column: a Llama head's layout)
            (1, 256, 12288, 6),
        ] {
            let mut b = Builder::default();
            let x = b.input(random(dtype, &[1, m, k], seed));
            let h = b.rms_norm(x, dtype, k, seed + 10);
            let w = b.weight(random(dtype, &[k, k], seed + 20));
            let y = b.node(Op::Linear, &[Some(h), Some(w), None]);
            let y = b.binary(BinaryOp::Add, x, y);
            // a second product from the same norm, with a bias, whose add
            // reads a broadcast residual
            let w2 = b.weight(random(dtype, &[n, k], seed + 30));
            let bias = b.weight(random(dtype, &[n], seed + 40));
            let z = b.node(Op::Linear, &[Some(h), Some(w2), Some(bias)]);
            let res = b.input(random(dtype, &[n], seed + 50));
            let z = b.binary(BinaryOp::Add, z, res);
            // a third (a layer's v): the three products are one dispatch
            let w3 = b.weight(random(dtype, &[n + 5, k], seed + 60));
            let v = b.node(Op::Linear, &[Some(h), Some(w3), None]);
            let what = format!("{dtype} m {m} k {k} n {n}");
            // z's bias and residual would bind too many buffers beside y's;
            // each product computes the norm's mean of squares itself
            b.check(&[y, z, v], tol(dtype), &what, &["linear"], 2);
        }
    }
}

/// `down(silu(gate) · up) + x`: the down product reads the gate as its
/// input (evaluated once a workgroup into workgroup memory; a Llama-3.2-1B
/// down product's `k` of 8192 in blocks, with a shorter last one; split
/// among workgroups for few columns, its parts added up by a second
/// dispatch) and stores the residual add.
#[test]
fn silu_gate_into_the_down_product() {
    for dtype in [DType::F32, DType::BF16] {
        for (m, k, n, products, seed) in [
            (1, 45, 21, 1, 5),
            (2, 128, 64, 1, 6),
            (5, 258, 7, 1, 7),
            (1, 8192, 512, 1, 8),
            (4, 8192, 64, 2, 9),
        ] {
            let mut b = Builder::default();
            let gate = b.input(random(dtype, &[1, m, k], seed));
            let up = b.input(random(dtype, &[1, m, k], seed + 1));
            let x = b.input(random(dtype, &[1, m, n], seed + 2));
            let s = b.node(Op::Unary(UnaryOp::Silu), &[Some(gate)]);
            let h = b.binary(BinaryOp::Mul, s, up);
            let w = b.weight(random(dtype, &[n, k], seed + 3));
            let y = b.node(Op::Linear, &[Some(h), Some(w), None]);
            let y = b.binary(BinaryOp::Add, y, x);
            let what = format!("{dtype} m {m} k {k} n {n}");
            b.check(&[y], tol(dtype), &what, &["linear"], products);
        }
    }
}

/// The dispatches whose kernel's first op is `op`, in order.
fn product_dispatches<'p>(
    payload: &'p etmetal_metal::payload::Payload,
    op: &str,
) -> Vec<&'p etmetal_metal::payload::Dispatch> {
    payload
        .dispatches
        .iter()
        .filter(|d| payload.kernels[d.kernel].ops[0] == op)
        .collect()
}

/// The names of the buffers `dispatch` writes, the graph's inputs aside.
fn intermediates_written(
    payload: &etmetal_metal::payload::Payload,
    dispatch: &etmetal_metal::payload::Dispatch,
    graph: &Graph,
) -> Vec<String> {
    let inputs: Vec<&str> = graph
        .inputs
        .iter()
        .map(|(v, _)| graph.value(*v).name.as_str())
        .collect();
    let kernel = &payload.kernels[dispatch.kernel];
    kernel
        .bindings
        .iter()
        .zip(&dispatch.buffers)
        .filter(|(a, _)| **a == etmetal_metal::payload::Access::ReadWrite)
        .map(|(_, &b)| payload.buffers[b].name.clone())
        .filter(|name| !inputs.contains(&name.as_str()))
        .collect()
}

/// A gated MLP as a decoder writes it, `down(act(gate(h)) · up(h)) + x`
/// after an RMSNorm: gate and up are one dispatch whose store writes only
/// the gated value (SiLU or GELU, either operand order, with and without
/// biases), which the down product reads as a plain vector (nothing
/// staged); where the gate is read elsewhere too, the products stay
/// siblings storing their own outputs. Against the CPU kernels.
#[test]
fn gated_products_store_only_the_gated_value() {
    for dtype in [DType::F32, DType::BF16] {
        for (m, k, n, act, swap, biased, seed) in [
            (1, 64, 96, UnaryOp::Silu, false, false, 1),
            (3, 40, 22, UnaryOp::Gelu { tanh: true }, true, true, 2),
            (8, 136, 70, UnaryOp::Silu, false, true, 3),
            (1, 256, 1030, UnaryOp::Silu, true, false, 4),
        ] {
            let what = format!("{dtype} m {m} k {k} n {n} {act:?}");
            for shared_gate in [false, true] {
                let mut b = Builder::default();
                let x = b.input(random(dtype, &[1, m, k], seed));
                let h = b.rms_norm(x, dtype, k, seed + 10);
                let linear = |b: &mut Builder, s: u64| {
                    let w = b.weight(random(dtype, &[n, k], seed + s));
                    let bias = biased.then(|| b.weight(random(dtype, &[n], seed + s + 1)));
                    b.node(Op::Linear, &[Some(h), Some(w), bias])
                };
                let gate = linear(&mut b, 20);
                let up = linear(&mut b, 30);
                let g = b.node(Op::Unary(act), &[Some(gate)]);
                let gated = match swap {
                    true => b.binary(BinaryOp::Mul, up, g),
                    false => b.binary(BinaryOp::Mul, g, up),
                };
                let wd = b.weight(random(dtype, &[k, n], seed + 40));
                let y = b.node(Op::Linear, &[Some(gated), Some(wd), None]);
                let y = b.binary(BinaryOp::Add, y, x);
                let mut outputs = vec![y];
                if shared_gate {
                    outputs.push(b.binary(BinaryOp::Add, gate, gate));
                }
                let mut graph = b.graph.clone();
                for &v in &outputs {
                    graph.outputs.push((v, OutputKind::User));
                }
                let payload = &compile_whole_within(&graph, &DeviceLimits::default()).methods[0]
                    .partitions[0]
                    .payload;
                let products = product_dispatches(payload, "linear");
                assert_eq!(products.len(), 2, "{what}: {} products", products.len());
                let written = intermediates_written(payload, products[0], &b.graph);
                let gated_name = b.graph.value(gated).name.clone();
                match shared_gate {
                    false => {
                        assert_eq!(written, [gated_name], "{what}");
                        let down = &payload.kernels[products[1].kernel];
                        assert!(
                            !down.wgsl.contains("var<workgroup> xs"),
                            "{what}: the down product stages its input"
                        );
                    }
                    true => assert!(
                        written.contains(&b.graph.value(gate).name),
                        "{what}: {written:?}"
                    ),
                }
                let what = format!("{what}, gate read elsewhere: {shared_gate}");
                let kernels = ["linear", "add"];
                b.check(&outputs, tol(dtype), &what, &kernels, 2);
            }
        }
    }
}

/// A prefill-sized bf16 linear whose store adds its bias and a residual,
/// on each emulated tensor-core form in each of its GEMM variants: the
/// add is the product's store, not a dispatch of its own.
#[test]
fn residual_add_in_the_tensor_core_store() {
    let bf = DType::BF16;
    let mut b = Builder::default();
    let x = b.input(random(bf, &[1, 100, 96], 1));
    let w = b.weight(random(bf, &[130, 96], 2));
    let bias = b.weight(random(bf, &[130], 3));
    let y = b.node(Op::Linear, &[Some(x), Some(w), Some(bias)]);
    let res = b.input(random(bf, &[1, 100, 130], 4));
    let y = b.binary(BinaryOp::Add, y, res);
    b.graph.outputs.push((y, OutputKind::User));
    let payload =
        &compile_whole_within(&b.graph, &DeviceLimits::default()).methods[0].partitions[0].payload;
    let ops: Vec<&[String]> = payload
        .dispatches
        .iter()
        .map(|d| payload.kernels[d.kernel].ops.as_slice())
        .collect();
    assert!(ops.iter().all(|o| o[0] != "add"), "{ops:?}");
    for e in emulations(&[CoopForm::Half16, CoopForm::Float8]) {
        let what = format!("linear + residual {e:?}");
        check_graph_emulating(&b.graph, b.inputs.clone(), BF16_TOL, e, &what);
    }
}

/// Reductions over dims of size 1 are casts of their input, fused into
/// their readers (int32 sums widen to int64, `any` of int32 is a bool).
#[test]
fn reductions_over_size_one_dims() {
    let x = random(DType::F32, &[3, 1, 5], 11);
    for (op, keepdim, dtype) in [
        (ReduceOp::Sum, false, DType::F32),
        (ReduceOp::Mean, true, DType::BF16),
        (ReduceOp::Max, false, DType::F32),
        (ReduceOp::Prod, true, DType::F32),
        (ReduceOp::Any, false, DType::F32),
        (ReduceOp::All, true, DType::F32),
    ] {
        let t = Tensor::from_f32(dtype, x.shape(), &x.to_f32_vec()).unwrap();
        let mut b = Builder::default();
        let v = b.input(t);
        let r = b.node(
            Op::Reduce {
                op,
                dims: vec![1],
                keepdim,
            },
            &[Some(v)],
        );
        // (the output written by a flat kernel: no reduction kernel)
        b.check(&[r], 0.0, &format!("{op:?} {dtype}"), &["copy"], 0);
    }
    let ints = Tensor::from_i64(DType::I32, &[2, 1, 3], &[0, 3, -5, 1, 0, 7]).unwrap();
    for op in [ReduceOp::Any, ReduceOp::Sum] {
        let mut b = Builder::default();
        let v = b.input(ints.clone());
        let r = b.node(
            Op::Reduce {
                op,
                dims: vec![1],
                keepdim: false,
            },
            &[Some(v)],
        );
        b.check(&[r], 0.0, &format!("{op:?} int32"), &["copy"], 0);
    }
}

/// Outputs that are one computation of separate nodes (transformers'
/// static cache: every layer's `cumulative_length` becomes
/// `cache_position[0] + 1`) are written by one kernel, each output still
/// its value; other computations keep kernels of their own.
#[test]
fn outputs_of_one_computation_are_written_once() {
    let mut b = Builder::default();
    let pos = b.input(Tensor::from_i64(DType::I64, &[2], &[511, 7]).unwrap());
    let x = b.input(random(DType::F32, &[5], 31));
    let one = b.weight(Tensor::from_i64(DType::I64, &[], &[1]).unwrap());
    let two = b.weight(Tensor::from_i64(DType::I64, &[], &[2]).unwrap());
    let mut outputs: Vec<ValueId> = (0..4).map(|_| b.binary(BinaryOp::Add, pos, one)).collect();
    outputs.push(b.binary(BinaryOp::Add, pos, two));
    outputs.push(b.binary(BinaryOp::Mul, x, x));
    for &v in &outputs {
        b.graph.outputs.push((v, OutputKind::User));
    }
    let payload =
        &compile_whole_within(&b.graph, &DeviceLimits::default()).methods[0].partitions[0].payload;
    let kernels: Vec<&str> = payload
        .dispatches
        .iter()
        .map(|d| payload.kernels[d.kernel].ops[0].as_str())
        .collect();
    assert_eq!(kernels, ["add", "add", "mul"], "one kernel a computation");
    assert_eq!(payload.outputs.len(), outputs.len());
    check_graph(&b.graph, b.inputs, 0.0, "repeated outputs");
}

/// The greedy token: argmax over a vocabulary-sized last dim (odd sizes).
#[test]
fn argmax_over_a_vocabulary() {
    for (dtype, shape, seed) in [
        (DType::F32, vec![1, 1, 32003], 21),
        (DType::BF16, vec![1, 50257], 22),
        (DType::F32, vec![3, 1001], 23),
    ] {
        let last = shape.len() - 1;
        OpCase::new(Op::ArgReduce {
            max: true,
            dim: Some(last),
            keepdim: false,
        })
        .input(random(dtype, &shape, seed))
        .check(0.0);
    }
}

/// Int32 words of random 4-bit codes (every bit pattern is eight codes).
fn random_words(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let words: Vec<i64> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            i64::from((s >> 32) as u32 as i32)
        })
        .collect();
    Tensor::from_i64(DType::I32, shape, &words).unwrap()
}

/// The matrix-vector product's 16-byte chunks at shapes that stress its
/// indexing: `k` of a few elements, not a multiple of the chunk (8 for
/// 16-bit weights, 4 for f32) or of the 4-element fallback, columns not a
/// multiple of a workgroup's (2051 columns: 4 a workgroup), a deep `k`
/// split among workgroups, a depth with whole unrolled passes and a tail,
/// and up to 8 rows, in f32, bf16 and f16.
#[test]
fn matrix_vector_chunks_at_odd_shapes() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (m, k, n, seed) in [
            (1, 1, 5, 31),
            (2, 3, 7, 32),
            (1, 8, 9, 33),
            (3, 12, 2051, 34),
            (1, 1020, 33, 35),
            (4, 1022, 17, 36),
            (1, 4096, 6, 37),
            (1, 2400, 2051, 38),
            (8, 264, 130, 39),
        ] {
            OpCase::new(Op::Linear)
                .input(random(dtype, &[m, k], seed))
                .weight(random(dtype, &[n, k], seed + 1))
                .absent()
                .check(tol(dtype));
        }
    }
}

/// The int4 GEMM of prefill on the tensor-core kernels, each form emulated
/// (any adapter runs them): the weight dequantized as it is staged (four
/// codes of a word, one scale and zero), the 16×16 form's pre-pass scaling
/// rows of W into f16's range, rows not a multiple of the tile, groups of
/// 32 and 128, bf16 and f16 activations.
#[test]
fn int4_gemm_on_emulated_tensor_cores() {
    for (dtype, g, m, n, k, seed) in [
        (DType::BF16, 32, 70, 96, 256, 61),
        (DType::F16, 128, 33, 130, 512, 62),
    ] {
        {
            let scales = random(dtype, &[n, k / g], seed + 2).to_f32_vec();
            let scales: Vec<f32> = scales.iter().map(|s| s * 0.05).collect();
            let (graph, inputs) = OpCase::new(Op::Int4Linear { group_size: g })
                .input(random(dtype, &[m, k], seed))
                .weight(random_words(&[n, k / 8], seed + 1))
                .weight(Tensor::from_f32(dtype, &[n, k / g], &scales).unwrap())
                .weight(random(dtype, &[n, k / g], seed + 3))
                .build();
            for form in [CoopForm::Half16, CoopForm::Float8] {
                let what = format!("int4 {dtype} g {g} m {m} n {n} k {k}");
                check_graph_emulating(&graph, inputs.clone(), BF16_TOL, (form, 0), &what);
            }
        }
    }
}

/// The int4 decode kernel (16-byte word chunks, a scale and zero per
/// chunk, codes turned into floats in registers) at every group size, for
/// 1 to 8 rows, channels not a multiple of a workgroup's, depths with
/// whole unrolled passes and a tail; and gather_qmv, each row its expert.
#[test]
fn int4_matrix_vector_at_every_group_size() {
    for dtype in [DType::F32, DType::BF16] {
        for (g, m, n, k, seed) in [
            (32, 1, 37, 256, 41),
            (64, 3, 19, 512, 42),
            (128, 8, 2051, 256, 43),
            (256, 1, 2051, 1280 + 256, 44),
            (32, 1, 7, 9600, 45),
            (128, 2, 1030, 4096, 46),
        ] {
            let scales = random(dtype, &[n, k / g], seed + 2).to_f32_vec();
            // small scales keep every output within bf16's reach of the CPU's
            let scales: Vec<f32> = scales.iter().map(|s| s * 0.05).collect();
            let what = format!("int4 {dtype} g {g} m {m} n {n} k {k}");
            let (graph, inputs) = OpCase::new(Op::Int4Linear { group_size: g })
                .input(random(dtype, &[m, k], seed))
                .weight(random_words(&[n, k / 8], seed + 1))
                .weight(Tensor::from_f32(dtype, &[n, k / g], &scales).unwrap())
                .weight(random(dtype, &[n, k / g], seed + 3))
                .build();
            check_graph(&graph, inputs, tol(dtype), &what);
        }
    }
    let (e, p, n, k, g) = (3, 4, 70, 512, 64);
    let (graph, inputs) = OpCase::new(Op::GatherQmv { group_size: g })
        .input(random(DType::F32, &[p, k], 47))
        .weight(random_words(&[e, n, k / 8], 48))
        .weight(random(DType::F32, &[e, n, k / g], 49))
        .weight(random(DType::F32, &[e, n, k / g], 50))
        .input(Tensor::from_i64(DType::I32, &[p], &[2, 0, 2, 1]).unwrap())
        .build();
    check_graph(&graph, inputs, TOL, "gather_qmv");
}

/// The int8 linear (8-bit codes, four a word) on the GPU against the CPU:
/// the decode kernel (1 to 8 rows) per output channel (a group of all of
/// K) and per group, and the tiled prefill kernel; the prefill GEMM on the
/// emulated tensor-core forms too.
#[test]
fn int8_linear_decode_and_prefill() {
    use etmetal_core::quant::QuantFormat;
    let case = |dtype: DType, g: usize, m: usize, n: usize, k: usize, seed: u64| {
        let scales = random(dtype, &[n, k / g], seed + 2).to_f32_vec();
        // 8-bit codes are 16 times int4's: smaller scales keep every
        // output within bf16's reach of the CPU's
        let scales: Vec<f32> = scales.iter().map(|s| s * 0.003).collect();
        OpCase::new(QuantFormat::int8(g).linear_op())
            .input(random(dtype, &[m, k], seed))
            .weight(random_words(&[n, k / 4], seed + 1))
            .weight(Tensor::from_f32(dtype, &[n, k / g], &scales).unwrap())
            .weight(random(dtype, &[n, k / g], seed + 3))
            .build()
    };
    for dtype in [DType::F32, DType::BF16] {
        for (g, m, n, k, seed) in [
            (640, 1, 37, 640, 71),
            (32, 3, 19, 256, 72),
            (128, 8, 70, 512, 73),
            (96, 1, 7, 96, 74),
            (256, 20, 33, 512, 75),
        ] {
            let what = format!("int8 {dtype} g {g} m {m} n {n} k {k}");
            let (graph, inputs) = case(dtype, g, m, n, k, seed);
            check_graph(&graph, inputs, tol(dtype), &what);
        }
    }
    let (graph, inputs) = case(DType::BF16, 256, 70, 96, 256, 76);
    for form in [CoopForm::Half16, CoopForm::Float8] {
        let what = format!("int8 bf16 g 256 m 70 n 96 k 256 {form:?}");
        check_graph_emulating(&graph, inputs.clone(), BF16_TOL, (form, 0), &what);
    }
}

/// A quantized decode product whose input is computed (an RMSNorm's
/// scaling, a SiLU gate) deep enough that the kernel evaluates its input
/// once per workgroup into workgroup memory: int4 in one block (k 2048), in
/// two (k 4096; two rows at k 2048) and in seven (k 7168, groups of 128);
/// int8 in two (k 4096), the residual add in the store, within the 16 KiB
/// every adapter offers.
#[test]
fn quantized_product_stages_a_computed_input_in_blocks() {
    use etmetal_core::quant::QuantFormat;
    for dtype in [DType::F32, DType::BF16] {
        for (m, k, n, format, norm, seed) in [
            (1, 2048, 40, QuantFormat::int4(32), true, 61),
            (1, 4096, 37, QuantFormat::int4(64), false, 62),
            (2, 2048, 19, QuantFormat::int4(32), true, 63),
            (1, 7168, 11, QuantFormat::int4(128), false, 64),
            (1, 4096, 23, QuantFormat::int8(32), true, 65),
        ] {
            let g = format.group_size;
            let mut b = Builder::default();
            let h = if norm {
                let x = b.input(random(dtype, &[1, m, k], seed));
                b.rms_norm(x, dtype, k, seed + 1)
            } else {
                let gate = b.input(random(dtype, &[1, m, k], seed));
                let up = b.input(random(dtype, &[1, m, k], seed + 1));
                let s = b.node(Op::Unary(UnaryOp::Silu), &[Some(gate)]);
                b.binary(BinaryOp::Mul, s, up)
            };
            let packed = b.weight(random_words(&[n, k / format.per_word()], seed + 2));
            // small scales keep every output within bf16's reach of the
            // CPU's (8-bit codes are 16 times int4's)
            let shrink = if format.bits == 8 { 0.002 } else { 0.02 };
            let scales = random(dtype, &[n, k / g], seed + 3).to_f32_vec();
            let scales: Vec<f32> = scales.iter().map(|s| s * shrink).collect();
            let scales = b.weight(Tensor::from_f32(dtype, &[n, k / g], &scales).unwrap());
            let zeros = b.weight(random(dtype, &[n, k / g], seed + 4));
            let y = b.node(
                format.linear_op(),
                &[Some(h), Some(packed), Some(scales), Some(zeros)],
            );
            let res = b.input(random(dtype, &[1, m, n], seed + 5));
            let y = b.binary(BinaryOp::Add, y, res);
            let what = format!("{} {dtype} m {m} k {k} n {n} g {g}", format.name());
            b.graph.outputs.push((y, OutputKind::User));
            let compiled = compile_whole_within(&b.graph, &DeviceLimits::default());
            let payload = &compiled.methods[0].partitions[0].payload;
            let product = payload
                .dispatches
                .iter()
                .map(|d| &payload.kernels[d.kernel])
                .find(|k| k.ops[0] == format.linear_op().name())
                .unwrap_or_else(|| panic!("{what}: no product kernel"));
            assert!(
                product.wgsl.contains("var<workgroup> xs"),
                "{what}: the input is not staged"
            );
            assert!(
                payload.requirements.max_compute_workgroup_storage_size <= 16384,
                "{what}: {:?}",
                payload.requirements
            );
            check_graph(&b.graph, b.inputs, tol(dtype), &what);
        }
    }
}

/// A quantized gated MLP, `down(silu(gate(h)) · up(h)) + x` after an
/// RMSNorm, int4 and int8: gate and up (merged into one product of both
/// weights) are one dispatch storing only the gated value, which the down
/// product reads as a plain vector (nothing staged). Against the CPU
/// kernels.
#[test]
fn quantized_gated_products_store_only_the_gated_value() {
    use etmetal_core::quant::QuantFormat;
    for dtype in [DType::F32, DType::BF16] {
        for (m, k, n, format, seed) in [
            (1, 256, 96, QuantFormat::int4(32), 71),
            (3, 128, 128, QuantFormat::int4(64), 72),
            (1, 512, 1056, QuantFormat::int4(32), 73),
            (2, 256, 64, QuantFormat::int8(32), 74),
        ] {
            let what = format!("{} {dtype} m {m} k {k} n {n}", format.name());
            let mut b = Builder::default();
            let x = b.input(random(dtype, &[1, m, k], seed));
            let h = b.rms_norm(x, dtype, k, seed + 10);
            let quantized = |b: &mut Builder, input: ValueId, n: usize, k: usize, s: u64| {
                let g = format.group_size;
                let packed = b.weight(random_words(&[n, k / format.per_word()], seed + s));
                // (scales and zeros as a quantizer makes them, zero about
                // -8 scales: small products keep the outputs within bf16's
                // reach)
                let small = |seed: u64, by: f32| {
                    let v = random(dtype, &[n, k / g], seed).to_f32_vec();
                    let v: Vec<f32> = v.iter().map(|x| x * by).collect();
                    Tensor::from_f32(dtype, &[n, k / g], &v).unwrap()
                };
                let scales = b.weight(small(seed + s + 1, 0.002));
                let zeros = b.weight(small(seed + s + 2, 0.016));
                let op = format.linear_op();
                b.node(op, &[Some(input), Some(packed), Some(scales), Some(zeros)])
            };
            let gate = quantized(&mut b, h, n, k, 20);
            let up = quantized(&mut b, h, n, k, 30);
            let s = b.node(Op::Unary(UnaryOp::Silu), &[Some(gate)]);
            let gated = b.binary(BinaryOp::Mul, s, up);
            let y = quantized(&mut b, gated, k, n, 40);
            let y = b.binary(BinaryOp::Add, y, x);
            b.graph.outputs.push((y, OutputKind::User));
            let compiled = compile_whole_within(&b.graph, &DeviceLimits::default());
            let payload = &compiled.methods[0].partitions[0].payload;
            let products = product_dispatches(payload, format.linear_op().name());
            assert_eq!(products.len(), 2, "{what}: {} products", products.len());
            let written = intermediates_written(payload, products[0], &b.graph);
            assert_eq!(written, [b.graph.value(gated).name.clone()], "{what}");
            let down = &payload.kernels[products[1].kernel];
            assert!(
                !down.wgsl.contains("var<workgroup> xs"),
                "{what}: the down product stages its input"
            );
            check_graph(&b.graph, b.inputs, tol(dtype), &what);
        }
    }
}

/// A convolution's eval batch norm, activation and skip connection's add
/// are computed in its store: one dispatch (and, for a 16-bit output, the
/// copy packing it), matching the CPU kernels. Implicit GEMM (grouped
/// too) and direct (depthwise, narrow) kernels, 1-D and 2-D, f32 / bf16 /
/// f16.
#[test]
fn batch_norm_activation_and_residual_in_the_convolution_store() {
    use etmetal_core::ConvAttrs;
    struct Case {
        dtype: DType,
        /// `[n, c, spatial…]`; the output has `cout` channels, same spatial
        /// dims (stride 1, padding k/2).
        x: Vec<usize>,
        cout: usize,
        k: usize,
        groups: usize,
        act: UnaryOp,
        residual: bool,
    }
    let relu6 = UnaryOp::Clamp {
        min: Some(0.0),
        max: Some(6.0),
    };
    let cases = [
        // a ResNet basic block's second conv: GEMM, BN, add, ReLU
        (DType::F32, vec![2, 16, 7, 6], 16, 3, 1, UnaryOp::Relu, true),
        (
            DType::BF16,
            vec![1, 8, 5, 5],
            16,
            3,
            1,
            UnaryOp::Relu,
            false,
        ),
        (DType::F16, vec![1, 8, 6, 5], 8, 1, 1, UnaryOp::Silu, false),
        // grouped GEMM (16 output channels a group)
        (
            DType::F32,
            vec![1, 8, 5, 6],
            32,
            3,
            2,
            UnaryOp::Hardswish,
            false,
        ),
        // MobileNet's depthwise conv (direct kernel), ReLU6
        (DType::F32, vec![2, 12, 9, 8], 12, 3, 12, relu6, false),
        (DType::BF16, vec![1, 6, 7, 7], 6, 3, 6, relu6, true),
        // a narrow 1-D conv with GELU and a residual
        (
            DType::F32,
            vec![2, 4, 11],
            4,
            3,
            1,
            UnaryOp::Gelu { tanh: false },
            true,
        ),
        (DType::BF16, vec![1, 16, 9], 16, 5, 1, UnaryOp::Relu, true),
    ]
    .map(|(dtype, x, cout, k, groups, act, residual)| Case {
        dtype,
        x,
        cout,
        k,
        groups,
        act,
        residual,
    });
    for (i, c) in cases.iter().enumerate() {
        let seed = 100 * i as u64;
        let sr = c.x.len() - 2;
        let mut b = Builder::default();
        let x = b.input(random(c.dtype, &c.x, seed));
        let mut wshape = vec![c.cout, c.x[1] / c.groups];
        wshape.resize(sr + 2, c.k);
        let w = b.weight(random(c.dtype, &wshape, seed + 1));
        let conv = Op::Convolution(ConvAttrs {
            stride: vec![1; sr],
            padding: vec![c.k / 2; sr],
            dilation: vec![1; sr],
            transposed: false,
            output_padding: vec![0; sr],
            groups: c.groups,
        });
        let y = b.node(conv, &[Some(x), Some(w), None]);
        let positive: Vec<f32> = random(DType::F32, &[c.cout], seed + 2)
            .to_f32_vec()
            .iter()
            .map(|v| v.abs() + 0.5)
            .collect();
        let var = Tensor::from_f32(c.dtype, &[c.cout], &positive).unwrap();
        let params = [
            random(c.dtype, &[c.cout], seed + 3),
            random(c.dtype, &[c.cout], seed + 4),
            random(c.dtype, &[c.cout], seed + 5),
            var,
        ]
        .map(|t| Some(b.weight(t)));
        let bn = Op::BatchNorm { eps: 1e-5 };
        let y = b.node(bn, &[Some(y), params[0], params[1], params[2], params[3]]);
        let y = match c.residual {
            true => b.binary(BinaryOp::Add, y, x),
            false => y,
        };
        let y = b.node(Op::Unary(c.act), &[Some(y)]);
        let what = format!(
            "{} {:?} cout {} k {} groups {} {:?} residual {}",
            c.dtype, c.x, c.cout, c.k, c.groups, c.act, c.residual
        );
        b.graph.outputs.push((y, OutputKind::User));
        let payload = &compile_whole_within(&b.graph, &DeviceLimits::default()).methods[0]
            .partitions[0]
            .payload;
        let ops: Vec<&[String]> = payload
            .dispatches
            .iter()
            .map(|d| payload.kernels[d.kernel].ops.as_slice())
            .collect();
        let packs = usize::from(c.dtype.size() == 2);
        let convs = ops.iter().filter(|o| o[0] == "convolution").count();
        let copies = ops.iter().filter(|o| o[0] == "copy").count();
        assert!(
            convs == 1 && copies <= packs && ops.len() == convs + copies,
            "{what}: dispatches {ops:?}"
        );
        check_graph(&b.graph, b.inputs, tol(c.dtype), &what);
    }
}
