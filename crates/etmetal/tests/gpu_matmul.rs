//! GPU matrix products, convolutions and pooling against the CPU kernels:
//! odd sizes, size-1 dims, 1-D operands, broadcast batches, permuted
//! (non-contiguous) inputs, every tile shape of the GEMM, f32 and bf16,
//! and the tensor-core alternative of f16/bf16 products.

mod common;

use std::sync::Arc;

use common::gpu::{
    adapter_offers_coop, assert_close, check_dynamic, compile_emulating, compile_whole, emulations,
    load_method_on, random, run_pte, Emulation, OpCase,
};
use etmetal_core::{AvgPoolAttrs, ConvAttrs, DType, MaxPoolAttrs, Op, Tensor};
use etmetal_metal::preprocess::{CoopForm, GEMM_COOP_VARIANTS};
use etmetal_metal_runtime::{DeviceChoice, MetalBackend};

const F: DType = DType::F32;
const BF: DType = DType::BF16;
const TOL: f32 = 1e-5;
/// f32 products over k >= 1024: each side's rounding alone reaches a few
/// 1e-5 (against f64, the gemm crate's AVX2 and AVX-512 kernels miss
/// [100, 1024] @ [1024, 3] by up to 4e-5 and 2e-5, a sequential sum by
/// 3e-5), so TOL holds only as long as both sides happen to round alike.
const DEEP_TOL: f32 = 1e-4;
const BF_TOL: f32 = 1e-2;

#[test]
fn matmul_shapes_follow_torch_matmul() {
    let cases: &[(&[usize], &[usize])] = &[
        (&[5, 7], &[7, 3]),
        (&[70, 33], &[33, 65]),
        (&[7], &[7]),
        (&[7], &[2, 7, 3]),
        (&[2, 5, 7], &[7]),
        (&[2, 1, 5, 7], &[3, 7, 4]),
        (&[3, 4, 1], &[1, 6]),
        // skinny tiles: one row, one column
        (&[1, 130], &[130, 200]),
        (&[90, 21], &[21, 2]),
        // the 128×128 tile
        (&[520, 8], &[8, 515]),
    ];
    for (i, (a, b)) in cases.iter().enumerate() {
        OpCase::new(Op::MatMul)
            .input(random(F, a, 2 * i as u64))
            .input(random(F, b, 2 * i as u64 + 1))
            .check(TOL);
    }
}

#[test]
fn matmul_reads_permuted_operands_and_bf16() {
    // [20, 9] @ [3, 9, 17], both read through transposes
    OpCase::new(Op::MatMul)
        .input_permuted(random(F, &[9, 20], 1), &[1, 0])
        .input_permuted(random(F, &[3, 17, 9], 2), &[0, 2, 1])
        .check(TOL);
    OpCase::new(Op::MatMul)
        .input(random(BF, &[2, 6, 35], 3))
        .input_permuted(random(BF, &[2, 19, 35], 4), &[0, 2, 1])
        .check(BF_TOL);
}

#[test]
fn addmm_applies_alpha_beta_and_broadcast_bias() {
    let cases: &[(f64, f64, &[usize])] = &[
        (0.5, 2.0, &[3]),
        (1.0, 1.0, &[40, 1]),
        (1.0, -1.5, &[40, 3]),
        (0.0, 1.0, &[3]),
    ];
    for (i, &(beta, alpha, bias)) in cases.iter().enumerate() {
        let m = if bias.len() == 2 { 40 } else { 4 };
        let seed = 10 * i as u64;
        OpCase::new(Op::Addmm { beta, alpha })
            .input(random(F, bias, seed))
            .input(random(F, &[m, 5], seed + 1))
            .input(random(F, &[5, 3], seed + 2))
            .check(TOL);
    }
}

#[test]
fn linear_with_and_without_bias() {
    OpCase::new(Op::Linear)
        .input(random(F, &[2, 3, 8], 1))
        .weight(random(F, &[40, 8], 2))
        .weight(random(F, &[40], 3))
        .check(TOL);
    OpCase::new(Op::Linear)
        .input(random(F, &[1, 64], 4))
        .weight(random(F, &[300, 64], 5))
        .absent()
        .check(TOL);
    OpCase::new(Op::Linear)
        .input_permuted(random(F, &[33, 6], 6), &[1, 0])
        .weight(random(F, &[1, 33], 7))
        .weight(random(F, &[1], 8))
        .check(TOL);
    OpCase::new(Op::Linear)
        .input(random(BF, &[3, 33], 9))
        .weight(random(BF, &[20, 33], 10))
        .weight(random(BF, &[20], 11))
        .check(BF_TOL);
}

/// Every tile shape of the GEMM, with sizes straddling the tile edges
/// (1, 63, 64, 65, 127, 129, 257), k not a multiple of the slice depth or
/// of 4, and tiles that need no bounds checks (m, n, k multiples of the
/// tile).
#[test]
fn gemm_tiles_cover_their_edges() {
    let cases: &[(usize, usize, usize)] = &[
        // rows ≤ 16: the matrix-vector tile
        (1, 63, 65),
        (2, 17, 257),
        (16, 9, 16),
        // columns ≤ 16
        (63, 64, 1),
        (257, 5, 3),
        // the 32×32 tile, exact (no checks) and overhanging
        (64, 16, 64),
        (128, 32, 128),
        (65, 5, 127),
        (127, 7, 129),
        (257, 3, 64),
    ];
    for (i, &(m, k, n)) in cases.iter().enumerate() {
        OpCase::new(Op::MatMul)
            .input(random(F, &[m, k], 3 * i as u64))
            .input(random(F, &[k, n], 3 * i as u64 + 1))
            .check(TOL);
    }
}

#[test]
fn gemm_64_tile_exact_and_overhanging() {
    // enough workgroups for 64×64 tiles: 32 batches of 2×4 exact tiles
    // (k = 32: two full slices), then 16 of 5×5 overhanging ones
    OpCase::new(Op::MatMul)
        .input(random(F, &[32, 128, 32], 1))
        .input(random(F, &[32, 32, 256], 2))
        .check(TOL);
    OpCase::new(Op::MatMul)
        .input(random(F, &[16, 257, 3], 3))
        .input_permuted(random(F, &[16, 257, 3], 4), &[0, 2, 1])
        .check(TOL);
}

#[test]
fn gemm_big_tile_broadcast_transposed_and_16_bit() {
    // 64 batches of 129×129 (2×2 overhanging 128×128 tiles: enough
    // workgroups for the big tile), B broadcast over the batch
    OpCase::new(Op::MatMul)
        .input(random(F, &[64, 129, 3], 1))
        .input(random(F, &[1, 3, 129], 2))
        .check(TOL);
    // both operands read through transposes, k = 9 (one full slice of 8 and
    // one of 1)
    OpCase::new(Op::MatMul)
        .input_permuted(random(F, &[64, 9, 130], 3), &[0, 2, 1])
        .input_permuted(random(F, &[64, 129, 9], 4), &[0, 2, 1])
        .check(TOL);
    OpCase::new(Op::MatMul)
        .input(random(BF, &[64, 129, 3], 5))
        .input_permuted(random(BF, &[64, 129, 3], 6), &[0, 2, 1])
        .check(BF_TOL);
}

#[test]
fn gemm_epilogue_bias_alpha_beta_and_16_bit_linear() {
    OpCase::new(Op::Linear)
        .input(random(F, &[65, 33], 1))
        .weight(random(F, &[127, 33], 2))
        .weight(random(F, &[127], 3))
        .check(TOL);
    OpCase::new(Op::Addmm {
        beta: -0.5,
        alpha: 1.5,
    })
    .input(random(F, &[64, 1], 4))
    .input(random(F, &[64, 20], 5))
    .input_permuted(random(F, &[129, 20], 6), &[1, 0])
    .check(TOL);
    for (dtype, seed) in [(BF, 7), (DType::F16, 10)] {
        OpCase::new(Op::Linear)
            .input(random(dtype, &[63, 21], seed))
            .weight(random(dtype, &[129, 21], seed + 1))
            .weight(random(dtype, &[129], seed + 2))
            .check(BF_TOL);
    }
}

/// The matrix-vector path (≤ 8 rows times a `k`-contiguous right operand):
/// rows 1, 2, 3, 8; 1, 2 and 4 columns a workgroup (n ≥ 1023 and ≥ 2045
/// give enough workgroups for 2 and 4) with a partial last block; k a
/// multiple of 4 (vector loads), not (element reads with a tail), and
/// below one chunk.
#[test]
fn gemv_rows_columns_and_chunks() {
    let cases: &[(usize, usize, usize)] = &[
        (1, 1024, 65),
        (2, 257, 31),
        (3, 36, 1023),
        (8, 64, 2050),
        (1, 3, 5),
        (8, 130, 9),
    ];
    for (i, &(m, k, n)) in cases.iter().enumerate() {
        let seed = 3 * i as u64;
        OpCase::new(Op::Linear)
            .input(random(F, &[m, k], seed))
            .weight(random(F, &[n, k], seed + 1))
            .weight(random(F, &[n], seed + 2))
            .check(TOL);
    }
}

#[test]
fn gemv_strided_operands_and_broadcast_batches() {
    // the row read through a transpose, the weight a transposed input
    // (element reads, not chunks)
    OpCase::new(Op::Linear)
        .input_permuted(random(F, &[40, 3], 1), &[1, 0])
        .input_permuted(random(F, &[40, 70], 2), &[1, 0])
        .absent()
        .check(TOL);
    // batched rows times a matrix: 2·3 rows
    OpCase::new(Op::Linear)
        .input(random(F, &[2, 3, 64], 3))
        .weight(random(F, &[33, 64], 4))
        .absent()
        .check(TOL);
    // bmm against transposed keys, both batches broadcast
    OpCase::new(Op::MatMul)
        .input(random(F, &[2, 1, 3, 40], 5))
        .input_permuted(random(F, &[4, 17, 40], 6), &[0, 2, 1])
        .check(TOL);
    OpCase::new(Op::MatMul)
        .input(random(F, &[5, 2, 41], 7))
        .input_permuted(random(F, &[1, 17, 41], 8), &[0, 2, 1])
        .check(TOL);
    OpCase::new(Op::Addmm {
        beta: 0.5,
        alpha: -2.0,
    })
    .input(random(F, &[4, 1], 9))
    .input(random(F, &[4, 28], 10))
    .input_permuted(random(F, &[19, 28], 11), &[1, 0])
    .check(TOL);
}

#[test]
fn gemv_16_bit_weights() {
    // bf16 chunks (two packed words a load), then f16 with k % 4 != 0
    for (dtype, m, k, n) in [
        (BF, 3, 64, 129),
        (BF, 1, 256, 1100),
        (DType::F16, 2, 66, 37),
    ] {
        OpCase::new(Op::Linear)
            .input(random(dtype, &[m, k], n as u64))
            .weight(random(dtype, &[n, k], n as u64 + 1))
            .weight(random(dtype, &[n], n as u64 + 2))
            .check(BF_TOL);
    }
    // the row read element by element, the weight in chunks: lanes of a
    // chunk must line up with the right k
    for dtype in [BF, DType::F16] {
        OpCase::new(Op::Linear)
            .input_permuted(random(dtype, &[32, 2], 1), &[1, 0])
            .weight(random(dtype, &[45, 32], 2))
            .absent()
            .check(BF_TOL);
    }
}

/// Deep `k` with too few tiles is split among workgroups and the parts
/// added by a second kernel (which applies bias, alpha/beta, rounding):
/// 32×32 tiles, both skinny tiles, the matrix-vector kernel, batches.
#[test]
fn split_k_products() {
    // 32×32 tiles, 4 splits (k = 512), bias once
    OpCase::new(Op::Linear)
        .input(random(F, &[40, 512], 1))
        .weight(random(F, &[40, 512], 2))
        .weight(random(F, &[40], 3))
        .check(TOL);
    OpCase::new(Op::Addmm {
        beta: 0.5,
        alpha: 2.0,
    })
    .input(random(F, &[33], 4))
    .input(random(F, &[40, 256], 5))
    .input(random(F, &[256, 33], 6))
    .check(TOL);
    // one row times a [k, n] matrix (the 16×64 tile), batched; few columns
    // (the 64×16 tile)
    OpCase::new(Op::MatMul)
        .input(random(F, &[4, 1, 1024], 7))
        .input(random(F, &[4, 1024, 30], 8))
        .check(DEEP_TOL);
    OpCase::new(Op::MatMul)
        .input(random(F, &[100, 1024], 9))
        .input(random(F, &[1024, 3], 10))
        .check(DEEP_TOL);
    // matrix-vector: 4 splits, then bf16 with 2
    OpCase::new(Op::Linear)
        .input(random(F, &[2, 2048], 11))
        .weight(random(F, &[10, 2048], 12))
        .weight(random(F, &[10], 13))
        .check(DEEP_TOL);
    OpCase::new(Op::Linear)
        .input(random(BF, &[1, 1024], 14))
        .weight(random(BF, &[7, 1024], 15))
        .weight(random(BF, &[7], 16))
        .check(BF_TOL);
}

/// `[160, 1024] @ [1024, 160]` splits `k` 8 ways, its partial sums (819 200
/// bytes) larger than any value (655 360): within a 700 000 byte limit it
/// splits fewer ways and loads on a device offering that binding.
#[test]
fn split_k_within_a_small_buffer_limit() {
    OpCase::new(Op::MatMul)
        .input(random(F, &[160, 1024], 17))
        .input(random(F, &[1024, 160], 18))
        .check_within(DEEP_TOL, 700_000);
}

fn conv(stride: &[usize], padding: &[usize], dilation: &[usize], groups: usize) -> Op {
    Op::Convolution(ConvAttrs {
        stride: stride.to_vec(),
        padding: padding.to_vec(),
        dilation: dilation.to_vec(),
        transposed: false,
        output_padding: vec![0; stride.len()],
        groups,
    })
}

#[test]
fn convolution_direct_and_implicit_gemm() {
    // depthwise 2-D (direct kernel), stride, padding and dilation per dim
    OpCase::new(conv(&[1, 2], &[1, 0], &[1, 2], 3))
        .input(random(F, &[2, 3, 9, 11], 1))
        .weight(random(F, &[3, 1, 3, 2], 2))
        .weight(random(F, &[3], 3))
        .check(TOL);
    // 1-D, two groups of 8 output channels (implicit GEMM), no bias
    OpCase::new(conv(&[2], &[1], &[1], 2))
        .input(random(F, &[1, 4, 17], 4))
        .weight(random(F, &[16, 2, 3], 5))
        .absent()
        .check(TOL);
    // 2-D 3×3 "same" convolution (implicit GEMM)
    OpCase::new(conv(&[1, 1], &[1, 1], &[1, 1], 1))
        .input(random(F, &[2, 5, 8, 7], 6))
        .weight(random(F, &[12, 5, 3, 3], 7))
        .weight(random(F, &[12], 8))
        .check(TOL);
    // channels-last input read through a permute, grouped, dilated
    OpCase::new(conv(&[2, 1], &[0, 2], &[1, 3], 2))
        .input_permuted(random(F, &[2, 9, 7, 6], 9), &[0, 3, 1, 2])
        .weight(random(F, &[20, 3, 2, 3], 10))
        .weight(random(F, &[20], 11))
        .check(TOL);
    // 1-D pointwise convolution in bf16 (direct), depthwise multiplier 2
    OpCase::new(conv(&[1], &[0], &[1], 1))
        .input(random(BF, &[2, 6, 9], 12))
        .weight(random(BF, &[4, 6, 1], 13))
        .weight(random(BF, &[4], 14))
        .check(BF_TOL);
    OpCase::new(conv(&[1], &[2], &[1], 4))
        .input(random(F, &[1, 4, 9], 15))
        .weight(random(F, &[8, 1, 5], 16))
        .absent()
        .check(TOL);
}

#[test]
fn max_pool_dilation_padding_and_ceil_mode() {
    for ceil_mode in [false, true] {
        let pool = |kernel: &[usize], stride: &[usize], padding: &[usize], dilation: &[usize]| {
            Op::MaxPool(MaxPoolAttrs {
                kernel: kernel.to_vec(),
                stride: stride.to_vec(),
                padding: padding.to_vec(),
                dilation: dilation.to_vec(),
                ceil_mode,
                with_indices: false,
            })
        };
        OpCase::new(pool(&[3, 2], &[2, 1], &[1, 1], &[2, 1]))
            .input(random(F, &[2, 3, 9, 8], 1))
            .check(0.0);
        OpCase::new(pool(&[3], &[2], &[1], &[1]))
            .input_permuted(random(F, &[10, 3], 2), &[1, 0])
            .check(0.0);
        OpCase::new(pool(&[2, 2], &[2, 2], &[0, 0], &[1, 1]))
            .input(random(BF, &[1, 2, 5, 7], 3))
            .check(0.0);
        // NaN wins its windows, as in PyTorch
        let v = [1.0, f32::NAN, 3.0, 0.5, 2.0, 7.0, f32::NAN, -1.0, 4.0];
        OpCase::new(pool(&[3], &[2], &[1], &[1]))
            .input(Tensor::from_f32(F, &[1, 9], &v).unwrap())
            .check(0.0);
    }
}

#[test]
fn avg_pool_divisor_rules() {
    for ceil_mode in [false, true] {
        for count_include_pad in [false, true] {
            for divisor_override in [None, Some(5)] {
                let pool = |kernel: &[usize], stride: &[usize], padding: &[usize]| {
                    Op::AvgPool(AvgPoolAttrs {
                        kernel: kernel.to_vec(),
                        stride: stride.to_vec(),
                        padding: padding.to_vec(),
                        ceil_mode,
                        count_include_pad,
                        divisor_override,
                    })
                };
                OpCase::new(pool(&[3], &[2], &[1]))
                    .input(random(F, &[3, 10], 1))
                    .check(TOL);
                OpCase::new(pool(&[3, 2], &[2, 2], &[1, 1]))
                    .input(random(F, &[2, 2, 7, 9], 2))
                    .check(TOL);
            }
        }
    }
}

#[test]
fn adaptive_avg_pool_windows() {
    let cases: &[(&[usize], &[usize], DType)] = &[
        (&[1, 2, 7, 5], &[3, 2], F),
        (&[2, 3, 10], &[4], BF),
        (&[2, 3, 6, 6], &[1, 1], F),
        (&[1, 3, 5], &[7], F),
    ];
    for (i, &(shape, output_size, dtype)) in cases.iter().enumerate() {
        let tol = if dtype == BF { BF_TOL } else { TOL };
        OpCase::new(Op::AdaptiveAvgPool {
            output_size: output_size.to_vec(),
        })
        .input(random(dtype, shape, i as u64))
        .check(tol);
    }
}

// ------------------------------------------------ tensor-core alternative
//
// f16/bf16 products of at least 2^18 multiply-adds with m, n ≥ 32 also get
// a cooperative-matrix form (etmetal-metal's `kernels/gemm/coop.rs`), which runs
// where the adapter offers 16×16×16 f16 matrices with f32 accumulators in
// subgroups of 32 (NVIDIA through Vulkan) and the portable kernel runs
// elsewhere (lavapipe). These cases run on whichever this machine has, and
// then with each form's kernels emulated (`compile_emulating`: the exact
// tensor-core kernels over plain WGSL arrays), which any adapter runs: on
// lavapipe that is the only way they run.

const H: DType = DType::F16;
/// Both tensor-core forms, emulated: NVIDIA's 16×16 f16 and Apple's 8×8 f32.
const FORMS: &[CoopForm] = &[CoopForm::Half16, CoopForm::Float8];

/// Forced, the alternative runs exactly where the adapter offers it and
/// computes what the CPU does; measured, it may run or not, and the result
/// is the same; turned off, the portable kernel runs.
#[test]
fn coop_alternative_runs_where_the_adapter_offers_it() {
    let (graph, inputs) = OpCase::new(Op::MatMul)
        .input(random(BF, &[256, 256], 1))
        .input(random(BF, &[256, 256], 2))
        .build();
    let expected = etmetal::eval::run_graph(&graph, inputs.clone()).unwrap();
    let pte = compile_whole(&graph);
    let offered = adapter_offers_coop();
    // each 16×16 variant forced in turn (on a real GPU: each one checked)
    let forced = (0..GEMM_COOP_VARIANTS).map(|n| {
        (
            "forced",
            MetalBackend::new(DeviceChoice::Auto).with_forced_alternative(n),
        )
    });
    let backends = forced.chain([
        // (the default)
        ("measured", MetalBackend::new(DeviceChoice::Auto)),
        (
            "off",
            MetalBackend::new(DeviceChoice::Auto).with_cooperative_matrix(false),
        ),
    ]);
    for (mode, gpu) in backends {
        let gpu = Arc::new(gpu);
        let mut method = load_method_on(gpu.clone(), &pte);
        let chosen = gpu.stats().alternatives_chosen;
        match mode {
            "forced" => assert_eq!(chosen, u64::from(offered), "forced, offered: {offered}"),
            "measured" => assert!(chosen <= u64::from(offered), "measured: {chosen}"),
            _ => assert_eq!(chosen, 0, "off"),
        }
        let got = method.execute(inputs.clone()).unwrap();
        assert_close(&got[0], &expected[0], BF_TOL, &format!("coop {mode}"));
    }
}

/// Tile edges (m, n not multiples of the tile or of 4), k tails (not a
/// multiple of the 32-deep slice, nor of 4), exact tiles, the skinny
/// 32-row and 32-column tiles, f16 and bf16 (whose rows and columns the
/// pre-passes scale into f16's range).
#[test]
fn coop_tile_edges_and_k_tails() {
    // (each case one dtype: every compile of an emulated kernel costs
    // lavapipe seconds)
    let cases: &[(usize, usize, usize, DType)] = &[
        (200, 72, 130, BF),
        (129, 33, 257, H),
        (97, 300, 65, BF),
        (64, 3, 2000, H),
        (40, 256, 100, BF),
        (300, 128, 48, H),
    ];
    for (i, &(m, k, n, dtype)) in cases.iter().enumerate() {
        let seed = 10 * i as u64;
        OpCase::new(Op::MatMul)
            .input(random(dtype, &[m, k], seed))
            .input(random(dtype, &[k, n], seed + 1))
            .check_gemm_coop(BF_TOL, FORMS);
    }
}

/// The 128×128 tile, both operands read through transposes (A along m,
/// B along k), batches with and without broadcasting. (The 128×128 tile
/// staged in workgroup memory takes 48 KiB, more than lavapipe's 32 KiB,
/// so it runs emulated only where the fragments load straight from the
/// f16 copies, 8 subgroups of 64×32 or 4 of 64×64; and in the 8×8 form,
/// whose tile is 64×64.)
#[test]
fn coop_big_tile_transposes_and_batches() {
    let (direct, wide) = ((CoopForm::Half16, 2), (CoopForm::Half16, 3));
    OpCase::new(Op::MatMul)
        .input(random(H, &[2048, 40], 1))
        .input(random(H, &[40, 2048], 2))
        .check_coop_emulating(BF_TOL, &[(CoopForm::Float8, 0), direct, wide]);
    OpCase::new(Op::MatMul)
        .input_permuted(random(BF, &[40, 2048], 1), &[1, 0])
        .input_permuted(random(BF, &[2048, 40], 2), &[1, 0])
        .check_coop_emulating(BF_TOL, &[direct, wide]);
    for dtype in [BF, H] {
        OpCase::new(Op::MatMul)
            .input_permuted(random(dtype, &[200, 300], 3), &[1, 0])
            .input_permuted(random(dtype, &[261, 200], 4), &[1, 0])
            .check_gemm_coop(BF_TOL, FORMS);
    }
    OpCase::new(Op::MatMul)
        .input(random(BF, &[4, 100, 64], 5))
        .input(random(BF, &[4, 64, 90], 6))
        .check_gemm_coop(BF_TOL, FORMS);
    OpCase::new(Op::MatMul)
        .input(random(BF, &[1, 100, 64], 7))
        .input_permuted(random(BF, &[3, 90, 64], 8), &[0, 2, 1])
        .check_gemm_coop(BF_TOL, FORMS);
}

/// The epilogue after the tensor cores: bias, alpha/beta, split-k partial
/// sums; and the implicit-GEMM convolution.
#[test]
fn coop_epilogue_bias_alpha_beta_split_k_and_convolution() {
    OpCase::new(Op::Linear)
        .input(random(BF, &[3, 100, 64], 1))
        .weight(random(BF, &[96, 64], 2))
        .weight(random(BF, &[96], 3))
        .check_gemm_coop(BF_TOL, FORMS);
    OpCase::new(Op::Addmm {
        beta: 0.5,
        alpha: 2.0,
    })
    .input(random(H, &[130], 4))
    .input(random(H, &[70, 90], 5))
    .input(random(H, &[90, 130], 6))
    .check_gemm_coop(BF_TOL, FORMS);
    // few tiles, deep k: split among workgroups, a second kernel adds
    OpCase::new(Op::MatMul)
        .input(random(H, &[2, 64, 4096], 7))
        .input(random(H, &[2, 4096, 64], 8))
        .check_gemm_coop(BF_TOL, FORMS);
    OpCase::new(conv(&[1, 1], &[1, 1], &[1, 1], 1))
        .input(random(BF, &[2, 16, 20, 20], 9))
        .weight(random(BF, &[64, 16, 3, 3], 10))
        .weight(random(BF, &[64], 11))
        .check_gemm_coop(BF_TOL, FORMS);
}

/// `x` scaled row by row (`row_scale(i)`), as `dtype`.
fn scaled(
    dtype: DType,
    shape: [usize; 2],
    seed: u64,
    scale: impl Fn(usize, usize) -> f32,
) -> Tensor {
    let base = random(DType::F32, &shape, seed).to_f32_vec();
    let v: Vec<f32> = base
        .iter()
        .enumerate()
        .map(|(e, x)| x * scale(e / shape[1], e % shape[1]))
        .collect();
    Tensor::from_f32(DType::F32, &shape, &v)
        .unwrap()
        .cast(dtype)
        .unwrap()
}

/// bf16 far outside f16's range, and rows and columns of very different
/// magnitudes in one operand (1e6 and 1e-25 rows, 1e-6 and 1e20 columns,
/// values straddling 65504, an infinity): every output within 1% of the
/// CPU's, relative to the sizes of its own terms, so a scale per tensor
/// (which flushes the small rows) fails here. (Outputs stay f32-normal:
/// GPUs flush f32 subnormals.)
#[test]
fn coop_bf16_range_scaling_beyond_f16() {
    let (m, k, n) = (128, 96, 128);
    let mut a = scaled(BF, [m, k], 1, |r, _| if r < 64 { 1e6 } else { 1e-25 });
    let b = scaled(BF, [k, n], 2, |_, c| if c < 64 { 1e-6 } else { 1e20 });
    let mut av = a.to_f32_vec();
    av[3 * k + 5] = 65504.0;
    av[3 * k + 6] = 65520.0;
    av[4 * k + 5] = -70000.0;
    av[5 * k + 7] = f32::INFINITY;
    a = Tensor::from_f32(DType::F32, &[m, k], &av)
        .unwrap()
        .cast(BF)
        .unwrap();
    let (graph, inputs) = OpCase::new(Op::MatMul)
        .input(a.clone())
        .input(b.clone())
        .build();
    let expected = etmetal::eval::run_graph(&graph, inputs.clone()).unwrap()[0].to_f32_vec();
    let (av, bv) = (a.to_f32_vec(), b.to_f32_vec());
    for (form, pte) in variants(&graph) {
        let got = run_pte(pte, inputs.clone())[0].to_f32_vec();
        for i in 0..m {
            for j in 0..n {
                let terms: f64 = (0..k)
                    .map(|l| (av[i * k + l] as f64 * bv[l * n + j] as f64).abs())
                    .sum();
                let (g, e) = (got[i * n + j], expected[i * n + j]);
                let ok = (g.is_nan() && e.is_nan())
                    || g == e
                    || ((g - e).abs() as f64) <= 1e-2 * (e.abs() as f64) + 1e-5 * terms;
                assert!(
                    ok,
                    "{form:?} [{i}, {j}]: GPU {g} vs CPU {e} (terms {terms:e})"
                );
            }
        }
    }
    // elements 2^29-2^37 below their row's largest, which alone meets
    // zeros: the output is their sum, within the module's bound
    // k·2^-27·max|A[i,:]|·max|B[:,j]| (exact where f16 subnormals are kept)
    let (m, k, n) = (64, 64, 64);
    let a = scaled(BF, [m, k], 5, |_, l| {
        if l == 0 {
            1.0
        } else {
            2f32.powi(-29 - (l % 9) as i32)
        }
    });
    let b = scaled(BF, [k, n], 6, |l, _| if l == 0 { 0.0 } else { 1.0 });
    let (graph, inputs) = OpCase::new(Op::MatMul)
        .input(a.clone())
        .input(b.clone())
        .build();
    let expected = etmetal::eval::run_graph(&graph, inputs.clone()).unwrap()[0].to_f32_vec();
    let (av, bv) = (a.to_f32_vec(), b.to_f32_vec());
    for (form, pte) in variants(&graph) {
        let got = run_pte(pte, inputs.clone())[0].to_f32_vec();
        let mut kept = true;
        for i in 0..m {
            let ra = (0..k).fold(0f32, |x, l| x.max(av[i * k + l].abs()));
            for j in 0..n {
                let cb = (0..k).fold(0f32, |x, l| x.max(bv[l * n + j].abs()));
                let (g, e) = (got[i * n + j], expected[i * n + j]);
                let bound = k as f32 * 2f32.powi(-27) * ra * cb;
                assert!(
                    (g - e).abs() <= bound,
                    "{form:?} [{i}, {j}]: GPU {g} vs CPU {e}"
                );
                kept &= (g - e).abs() <= 1e-2 * e.abs();
            }
        }
        eprintln!("{form:?}: f16 subnormals kept by the products: {kept}");
    }
    // f16 near its own limits (scaled like bf16)
    OpCase::new(Op::MatMul)
        .input(scaled(H, [64, 80], 3, |r, _| {
            if r % 2 == 0 {
                60000.0
            } else {
                1e-4
            }
        }))
        .input(scaled(H, [80, 96], 4, |_, _| 1e-3))
        .check_gemm_coop(BF_TOL, FORMS);
}

/// `graph` compiled with the tensor-core alternatives (`None`), and with
/// each form emulated in each of its GEMM variants.
fn variants(graph: &etmetal_graph::Graph) -> Vec<(Option<Emulation>, Vec<u8>)> {
    let mut v = vec![(None, compile_whole(graph))];
    v.extend(
        emulations(FORMS)
            .into_iter()
            .map(|(f, n)| (Some((f, n)), compile_emulating(graph, f, n))),
    );
    v
}

/// Products over a run-time number of rows (`torch.export.Dim`, bound 128)
/// or images (a convolution's batch, bound 4)
/// on the emulated tensor-core kernels: each row bucket (up to 64, up to
/// the bound) has its own, running the tiles of the actual rows; one
/// loaded program at 100, 1, 17 and 64 (a bucket's end) rows (the
/// largest first: the smaller runs find its rows past their own).
#[test]
fn coop_dynamic_rows() {
    const SIZES: [usize; 4] = [100, 1, 17, 64];
    let linear = |dtype: DType| {
        move |rows: usize| {
            OpCase::new(Op::Linear)
                .input(random(dtype, &[rows, 72], rows as u64))
                .weight(random(dtype, &[96, 72], 1))
                .weight(random(dtype, &[96], 2))
                .build()
        }
    };
    for emulated in emulations(FORMS) {
        let what = format!("dynamic bf16 linear {emulated:?}");
        check_dynamic(
            linear(BF),
            &[(0, 0)],
            128,
            &SIZES,
            BF_TOL,
            Some(emulated),
            &what,
        );
    }
    // a batch of rows times a user input (its columns scaled by a pre-pass)
    let matmul = |rows: usize| {
        OpCase::new(Op::MatMul)
            .input(random(H, &[2, rows, 40], rows as u64))
            .input(random(H, &[40, 80], 1))
            .build()
    };
    // a convolution over a run-time batch (bound 4): its images are the
    // product's n, bucketed by an eighth and a half of the bound
    let convolution = |images: usize| {
        OpCase::new(conv(&[1, 1], &[1, 1], &[1, 1], 1))
            .input(random(BF, &[images, 16, 12, 12], images as u64))
            .weight(random(BF, &[64, 16, 3, 3], 1))
            .weight(random(BF, &[64], 2))
            .build()
    };
    // (the variants reading f16 copies: fragments straight from them, and
    // staged)
    check_dynamic(
        convolution,
        &[(0, 0)],
        4,
        &[4, 1, 3],
        BF_TOL,
        Some((CoopForm::Half16, 2)),
        "dynamic bf16 conv",
    );
    let what = "dynamic f16 matmul";
    check_dynamic(
        matmul,
        &[(0, 1)],
        128,
        &SIZES,
        BF_TOL,
        Some((CoopForm::Half16, 1)),
        what,
    );
}
