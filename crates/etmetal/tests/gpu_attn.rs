//! GPU norms, attention, top-k, cumsum and advanced indexing against the
//! CPU kernels, on this machine's adapter (shapes kept small for lavapipe).

mod common;

use std::sync::Arc;

use common::gpu::{
    adapter_offers_coop, assert_close, check_dynamic, compile_whole, load_method_on, random,
    random_indices, OpCase,
};
use etmetal_core::{DType, Op, Tensor};
use etmetal_metal::preprocess::CoopForm;
use etmetal_metal_runtime::{DeviceChoice, MetalBackend};

const TOL: f32 = 1e-5;
const BF16_TOL: f32 = 1e-2;

/// `random` shifted into `[lo, lo + 2)` (variances, ties, …).
fn shifted(dtype: DType, shape: &[usize], seed: u64, lo: f32) -> Tensor {
    let v: Vec<f32> = random(DType::F32, shape, seed)
        .to_f32_vec()
        .iter()
        .map(|x| x + 1.0 + lo)
        .collect();
    Tensor::from_f32(dtype, shape, &v).unwrap()
}

fn ints(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::from_i64(DType::I64, shape, v).unwrap()
}

#[test]
fn layer_norm_f32_bf16_permuted_and_without_affine() {
    let ln = |nd| Op::LayerNorm {
        normalized_dims: nd,
        eps: 1e-5,
    };
    OpCase::new(ln(2))
        .input(random(DType::F32, &[3, 5, 7], 1))
        .weight(random(DType::F32, &[5, 7], 2))
        .weight(random(DType::F32, &[5, 7], 3))
        .check(TOL);
    OpCase::new(ln(1))
        .input(random(DType::BF16, &[4, 1, 130], 4))
        .weight(random(DType::BF16, &[130], 5))
        .weight(random(DType::BF16, &[130], 6))
        .check(BF16_TOL);
    OpCase::new(ln(1))
        .input_permuted(random(DType::F32, &[9, 2, 3], 7), &[1, 2, 0])
        .check(TOL);
    OpCase::new(ln(1))
        .input(random(DType::F32, &[2, 1], 8))
        .absent()
        .weight(random(DType::F32, &[1], 9))
        .check(TOL);
}

#[test]
fn rms_norm_default_and_given_eps() {
    for (dtype, tol) in [(DType::F32, TOL), (DType::BF16, BF16_TOL)] {
        OpCase::new(Op::RmsNorm {
            normalized_dims: 1,
            eps: None,
        })
        .input(random(dtype, &[6, 33], 10))
        .weight(random(dtype, &[33], 11))
        .check(tol);
    }
    OpCase::new(Op::RmsNorm {
        normalized_dims: 2,
        eps: Some(1e-3),
    })
    .input_permuted(random(DType::F32, &[5, 3, 4], 12), &[2, 0, 1])
    .check(TOL);
}

#[test]
fn group_norm_and_batch_norm() {
    OpCase::new(Op::GroupNorm {
        groups: 2,
        eps: 1e-5,
    })
    .input(random(DType::F32, &[2, 4, 3, 5], 13))
    .weight(random(DType::F32, &[4], 14))
    .weight(random(DType::F32, &[4], 15))
    .check(TOL);
    OpCase::new(Op::GroupNorm {
        groups: 3,
        eps: 1e-5,
    })
    .input(random(DType::BF16, &[1, 6, 7], 16))
    .check(BF16_TOL);
    for (dtype, tol) in [(DType::F32, TOL), (DType::BF16, BF16_TOL)] {
        OpCase::new(Op::BatchNorm { eps: 1e-5 })
            .input(random(dtype, &[2, 3, 4, 5], 17))
            .weight(random(dtype, &[3], 18))
            .weight(random(dtype, &[3], 19))
            .weight(random(dtype, &[3], 20))
            .weight(shifted(dtype, &[3], 21, 0.1))
            .check(tol);
    }
    OpCase::new(Op::BatchNorm { eps: 1e-3 })
        .input_permuted(random(DType::F32, &[5, 2, 3], 22), &[1, 2, 0])
        .absent()
        .absent()
        .weight(random(DType::F32, &[3], 23))
        .weight(shifted(DType::F32, &[3], 24, 0.1))
        .check(TOL);
}

fn sdpa(is_causal: bool, scale: Option<f64>, enable_gqa: bool) -> Op {
    Op::Sdpa {
        is_causal,
        scale,
        enable_gqa,
    }
}

#[test]
fn attention_prefill_causal_and_scaled() {
    // several query blocks and key tiles, causal
    OpCase::new(sdpa(true, None, false))
        .input(random(DType::F32, &[2, 70, 16], 30))
        .input(random(DType::F32, &[2, 70, 16], 31))
        .input(random(DType::F32, &[2, 70, 12], 32))
        .check(TOL);
    // L != S, explicit scale, k/v broadcast over heads, odd sizes
    OpCase::new(sdpa(false, Some(0.3), false))
        .input(random(DType::F32, &[1, 3, 11, 5], 33))
        .input(random(DType::F32, &[1, 1, 67, 5], 34))
        .input(random(DType::F32, &[1, 1, 67, 3], 35))
        .check(TOL);
    OpCase::new(sdpa(true, None, false))
        .input(random(DType::BF16, &[2, 9, 8], 36))
        .input(random(DType::BF16, &[2, 9, 8], 37))
        .input(random(DType::BF16, &[2, 9, 8], 38))
        .check(BF16_TOL);
}

#[test]
fn attention_decode_gqa_and_long_keys() {
    // one query row, 1600 keys, 4 query heads sharing 2 kv heads
    OpCase::new(sdpa(false, None, true))
        .input(random(DType::F32, &[1, 4, 1, 32], 40))
        .input(random(DType::F32, &[1, 2, 1600, 32], 41))
        .input(random(DType::F32, &[1, 2, 1600, 32], 42))
        .check(TOL);
    // head dims of 256 and 130 (several output columns per invocation)
    OpCase::new(sdpa(false, None, false))
        .input(random(DType::F32, &[1, 3, 256], 43))
        .input(random(DType::F32, &[1, 5, 256], 44))
        .input(random(DType::F32, &[1, 5, 130], 45))
        .check(TOL);
}

#[test]
fn attention_masks_and_strided_inputs() {
    // bool mask broadcast over batch and heads, one row fully masked (zeros)
    let mut keep: Vec<i64> = random_indices(&[6, 9], 2, 50).to_i64_vec();
    keep[9..18].iter_mut().for_each(|k| *k = 0);
    let mask = Tensor::from_i64(DType::Bool, &[6, 9], &keep).unwrap();
    OpCase::new(sdpa(false, None, false))
        .input(random(DType::F32, &[2, 2, 6, 4], 51))
        .input(random(DType::F32, &[2, 2, 9, 4], 52))
        .input(random(DType::F32, &[2, 2, 9, 4], 53))
        .input(mask)
        .check(TOL);
    // additive float mask per head; q and k read through permutes
    // ([N, L, H, E] → [N, H, L, E], as after a projection)
    OpCase::new(sdpa(false, None, false))
        .input_permuted(random(DType::F32, &[2, 5, 3, 8], 54), &[0, 2, 1, 3])
        .input_permuted(random(DType::F32, &[2, 7, 3, 8], 55), &[0, 2, 1, 3])
        .input(random(DType::F32, &[2, 3, 7, 8], 56))
        .input(random(DType::F32, &[3, 5, 7], 57))
        .check(TOL);
}

/// q `[heads, l, d]` (k/v `[heads / rep, s, d or dv]`) of `dtype`, checked
/// against the CPU kernel.
fn attention_case(op: Op, dtype: DType, heads: usize, l: usize, s: usize, d: usize, dv: usize) {
    let tol = if dtype == DType::F32 { TOL } else { BF16_TOL };
    let seed = (heads * 1000 + l * 100 + s * 10 + d + dv) as u64;
    let kv = if matches!(
        op,
        Op::Sdpa {
            enable_gqa: true,
            ..
        }
    ) {
        2
    } else {
        heads
    };
    OpCase::new(op)
        .input(random(dtype, &[1, heads, l, d], seed))
        .input(random(dtype, &[1, kv, s, d], seed + 1))
        .input(random(dtype, &[1, kv, s, dv], seed + 2))
        .check(tol);
}

#[test]
fn attention_lengths_off_the_tiles() {
    // query blocks of 32/64 rows, key tiles of 32, decode up to 4 rows
    for (l, s) in [(1, 7), (7, 33), (33, 65), (65, 130), (130, 33), (3, 129)] {
        for causal in [false, true] {
            attention_case(sdpa(causal, None, false), DType::F32, 2, l, s, 16, 16);
        }
    }
    // causal with more queries than keys (later rows see every key)
    attention_case(sdpa(true, None, false), DType::F32, 2, 40, 20, 8, 8);
}

#[test]
fn attention_head_dims_up_to_256() {
    // q in registers (16, 64), re-read per tile (80, 128, 256), output
    // columns over two slices (256, 200)
    for d in [16, 64, 80, 128, 256] {
        attention_case(sdpa(false, None, false), DType::F32, 1, 33, 40, d, d);
        attention_case(sdpa(false, None, false), DType::F32, 1, 2, 40, d, d);
    }
    attention_case(sdpa(true, None, false), DType::F32, 1, 20, 20, 128, 200);
    attention_case(sdpa(false, Some(0.2), false), DType::F32, 1, 1, 150, 7, 67);
}

#[test]
fn attention_one_query_many_keys_and_gqa() {
    // keys split over workgroups and combined
    attention_case(sdpa(false, None, false), DType::F32, 3, 1, 700, 64, 64);
    attention_case(sdpa(false, None, true), DType::F32, 6, 1, 700, 16, 16);
    attention_case(sdpa(true, None, true), DType::F32, 6, 37, 37, 16, 16);
    attention_case(sdpa(false, None, true), DType::F32, 4, 9, 300, 32, 32);
    // bf16 and f16 in, computed in f32, rounded on store
    attention_case(sdpa(true, None, false), DType::BF16, 2, 65, 65, 64, 64);
    attention_case(sdpa(false, None, false), DType::BF16, 2, 1, 300, 64, 64);
    attention_case(sdpa(false, None, false), DType::F16, 2, 5, 40, 16, 16);
}

/// The decode kernel reads a row of k or v 16 bytes a load (8 bytes for
/// 16-bit rows of a multiple of 4 but not 8) where the rows lie whole in a
/// buffer: head dims 64, 128 and 80 in every float dtype, 20 and 12
/// (narrower loads), 6 (element reads), a v of another head dim; 300 and
/// 1600 keys split over workgroups, GQA heads.
#[test]
fn decode_reads_k_and_v_rows_wide() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for d in [64, 128, 80] {
            attention_case(sdpa(false, None, true), dtype, 4, 1, 300, d, d);
        }
    }
    attention_case(sdpa(false, None, false), DType::BF16, 2, 1, 1600, 64, 64);
    attention_case(sdpa(false, None, false), DType::F32, 2, 1, 200, 20, 20);
    attention_case(sdpa(false, None, false), DType::BF16, 2, 2, 200, 12, 12);
    attention_case(sdpa(false, None, true), DType::BF16, 4, 1, 150, 6, 6);
    attention_case(sdpa(false, None, true), DType::BF16, 4, 3, 150, 64, 20);
    attention_case(sdpa(true, None, false), DType::F32, 2, 4, 300, 16, 8);
}

/// transformers' `repeat_kv`: `[b, kv, s, d]` to `[b, kv·rep, s, d]` by an
/// unsqueeze, an expand and a reshape (rows still whole in the cache).
fn repeat_kv(shape: &[usize], rep: usize) -> Vec<Op> {
    let &[b, kv, s, d] = shape else {
        panic!("{shape:?} is not [b, kv, s, d]")
    };
    vec![
        Op::Reshape {
            shape: vec![b, kv, 1, s, d],
        },
        Op::Expand {
            shape: vec![b, kv, rep, s, d],
        },
        Op::Reshape {
            shape: vec![b, kv * rep, s, d],
        },
    ]
}

/// k and v read through GQA's views (wide), k through a transpose of a
/// `[.., d, s]` tensor (element reads; as many keys as the head dim, so
/// that only the permute tells the rows apart), in bf16 and f32.
#[test]
fn decode_through_gqa_views_and_transposes() {
    for (dtype, tol) in [(DType::BF16, BF16_TOL), (DType::F32, TOL)] {
        let kv = [1, 2, 300, 64];
        OpCase::new(sdpa(false, None, false))
            .input(random(dtype, &[1, 8, 1, 64], 120))
            .input_through(random(dtype, &kv, 121), repeat_kv(&kv, 4))
            .input_through(random(dtype, &kv, 122), repeat_kv(&kv, 4))
            .check(tol);
        OpCase::new(sdpa(false, None, true))
            .input(random(dtype, &[1, 4, 1, 64], 123))
            .input_permuted(random(dtype, &[1, 2, 64, 64], 124), &[0, 1, 3, 2])
            .input(random(dtype, &[1, 2, 64, 64], 125))
            .check(tol);
    }
}

/// A KV cache of `s` positions holding keys up to `pos`: the mask (bool,
/// or additive 0 / −∞ in the model's dtype) keeps keys `0..=pos`; the keys
/// past it are never scored (their splits write empty partials). Its
/// first position, the middle of a split, a split's first key, the last
/// slot; GQA views of the caches as transformers reads them.
#[test]
fn decode_stops_at_the_masked_tail() {
    let s = 700;
    for dtype in [DType::F32, DType::BF16] {
        let tol = if dtype == DType::F32 { TOL } else { BF16_TOL };
        for pos in [0, 350, 384, s - 1] {
            let keep: Vec<i64> = (0..s).map(|j| i64::from(j <= pos)).collect();
            let bias: Vec<f32> = (0..s)
                .map(|j| if j <= pos { 0.0 } else { f32::NEG_INFINITY })
                .collect();
            let masks = [
                Tensor::from_i64(DType::Bool, &[1, 1, 1, s], &keep).unwrap(),
                Tensor::from_f32(dtype, &[1, 1, 1, s], &bias).unwrap(),
            ];
            let kv = [1, 2, s, 64];
            for mask in masks {
                OpCase::new(sdpa(false, None, false))
                    .input(random(dtype, &[1, 4, 1, 64], 130))
                    .input_through(random(dtype, &kv, 131), repeat_kv(&kv, 2))
                    .input_through(random(dtype, &kv, 132), repeat_kv(&kv, 2))
                    .input(mask)
                    .check(tol);
            }
        }
    }
}

/// With 256 query rows the keys are not split: a workgroup walks all 600
/// keys in chunks, its running max carried from chunk to chunk (each
/// chunk's max one atomic in one of two workgroup slots, reused every
/// other chunk), also across chunks the mask wholly removes (keys 100 to
/// 399) and with scores of both signs.
#[test]
fn decode_carries_its_max_across_many_chunks() {
    let (rows, s) = (256, 600);
    let keep: Vec<i64> = (0..s)
        .map(|j| i64::from(!(100..400).contains(&j)))
        .collect();
    let mask = Tensor::from_i64(DType::Bool, &[1, 1, 1, s], &keep).unwrap();
    for mask in [None, Some(mask)] {
        let mut case = OpCase::new(sdpa(false, None, false))
            .input(random(DType::F32, &[1, rows, 1, 8], 140))
            .input(random(DType::F32, &[1, rows, s, 8], 141))
            .input(random(DType::F32, &[1, rows, s, 8], 142));
        if let Some(m) = mask {
            case = case.input(m);
        }
        case.check(TOL);
    }
}

/// 40 queries over 4096 keys split the keys 128 ways, their partials
/// (204 800 bytes) larger than any value (131 072): within a 140 000 byte
/// limit the keys split fewer ways and the payload loads on a device
/// offering that binding.
#[test]
fn key_split_within_a_small_buffer_limit() {
    OpCase::new(sdpa(false, None, false))
        .input(random(DType::F32, &[1, 40, 8], 110))
        .input(random(DType::F32, &[1, 4096, 8], 111))
        .input(random(DType::F32, &[1, 4096, 8], 112))
        .check_within(TOL, 140_000);
}

#[test]
fn attention_wide_grids_do_not_split() {
    // 256 and more workgroups: one pass over the keys each
    OpCase::new(sdpa(false, None, false))
        .input(random(DType::F32, &[16, 16, 5, 8], 90))
        .input(random(DType::F32, &[16, 16, 9, 8], 91))
        .input(random(DType::F32, &[16, 16, 9, 8], 92))
        .check(TOL);
    OpCase::new(sdpa(true, None, false))
        .input(random(DType::F32, &[128, 66, 4], 93))
        .input(random(DType::F32, &[128, 70, 4], 94))
        .input(random(DType::F32, &[128, 70, 4], 95))
        .check(TOL);
    OpCase::new(sdpa(false, None, false))
        .input(random(DType::F32, &[300, 2, 4], 96))
        .input(random(DType::F32, &[300, 200, 4], 97))
        .input(random(DType::F32, &[300, 200, 4], 98))
        .check(TOL);
}

#[test]
fn attention_fully_masked_rows_are_zero() {
    // bool masks with rows of no key, prefill and split decode
    for (l, s) in [(40, 50), (1, 700), (3, 20)] {
        let mut keep = random_indices(&[2, l, s], 2, 100 + l as u64).to_i64_vec();
        keep[..s].iter_mut().for_each(|k| *k = 0);
        if l > 1 {
            keep[(2 * l - 1) * s..].iter_mut().for_each(|k| *k = 0);
        }
        let mask = Tensor::from_i64(DType::Bool, &[2, 1, l, s], &keep).unwrap();
        OpCase::new(sdpa(false, None, false))
            .input(random(DType::F32, &[2, 3, l, 16], 101))
            .input(random(DType::F32, &[2, 3, s, 16], 102))
            .input(random(DType::F32, &[2, 3, s, 16], 103))
            .input(mask)
            .check(TOL);
    }
    // an additive mask of −∞ over a whole row, broadcast over heads
    let mut bias = random(DType::F32, &[37, 45], 104).to_f32_vec();
    bias[5 * 45..6 * 45]
        .iter_mut()
        .for_each(|b| *b = f32::NEG_INFINITY);
    let bias = Tensor::from_f32(DType::F32, &[37, 45], &bias).unwrap();
    OpCase::new(sdpa(false, None, false))
        .input(random(DType::F32, &[2, 37, 16], 105))
        .input(random(DType::F32, &[2, 45, 16], 106))
        .input(random(DType::F32, &[2, 45, 16], 107))
        .input(bias)
        .check(TOL);
}

// ------------------------------------------- flash attention, tensor cores
//
// Prefill of head dim 64 or 128 (at least 32 query rows, 2^18
// multiply-adds) also gets tensor-core forms (etmetal-metal's
// `kernels/attention_coop.rs`): the 16×16 f16 one for f16 and bf16, the
// 8×8 f32 one for every float dtype. Each case runs as compiled (the
// alternatives where the adapter offers them) and with its forms emulated,
// which any adapter runs (on lavapipe, the only way they run).

const BOTH: &[CoopForm] = &[CoopForm::Half16, CoopForm::Float8];
const APPLE: &[CoopForm] = &[CoopForm::Float8];

/// Several query blocks and key tiles, rows and keys off the tiles
/// (150, 17, 1 keys), causal with GQA, head dims 64 and 128, bf16, f16 and
/// f32; small grids split the keys (the combine kernel merges the
/// tensor-core kernel's partials).
#[test]
fn attention_on_emulated_tensor_cores() {
    let (h, b, f) = (DType::F16, DType::BF16, DType::F32);
    // q [1, heads, l, d], k and v [1, kv, s, d]
    let case = |op: Op, dtype, [heads, l, s, d]: [usize; 4], kv, forms: &[CoopForm]| {
        let tol = if dtype == f { TOL } else { BF16_TOL };
        let seed = (heads * 1000 + l + s) as u64;
        OpCase::new(op)
            .input(random(dtype, &[1, heads, l, d], seed))
            .input(random(dtype, &[1, kv, s, d], seed + 1))
            .input(random(dtype, &[1, kv, s, d], seed + 2))
            .check_coop(tol, forms);
    };
    case(sdpa(false, None, false), b, [4, 150, 150, 64], 4, BOTH);
    // (head dim 128 in the 16×16 form only: lavapipe takes 15–55 s to
    // compile an emulated kernel of head dim 128, either form)
    case(
        sdpa(true, None, true),
        h,
        [8, 130, 150, 128],
        2,
        &[CoopForm::Half16],
    );
    case(sdpa(true, Some(0.2), false), f, [2, 70, 70, 64], 2, APPLE);
    case(sdpa(false, None, false), b, [8, 64, 17, 64], 8, BOTH);
    case(sdpa(false, None, false), h, [16, 256, 1, 64], 16, BOTH);
    // the prefetching twin of the smallest 16×16 variant (the next tiles
    // loaded into registers a tile ahead), and the smallest 32-row variant
    // and its twin (two matrices of q a subgroup, a row of scores a lane),
    // keys off the tiles, causal GQA
    OpCase::new(sdpa(true, None, true))
        .input(random(b, &[1, 4, 150, 64], 31))
        .input(random(b, &[1, 2, 150, 64], 32))
        .input(random(b, &[1, 2, 150, 64], 33))
        .check_coop_emulating(
            BF16_TOL,
            &[
                (CoopForm::Half16, 1),
                (CoopForm::Half16, 2),
                (CoopForm::Half16, 3),
            ],
        );
}

/// bf16 operands beyond f16's range, held only by the last rows of a
/// chunk of the pre-pass (150 keys: rows 140–149 of the third chunk of
/// 64): the 16×16 flash forms copy q and k to f16 scaled per head and v
/// per column, so k's 2^16 (past f16's 65504) and v's 2^20 must be found
/// wherever they sit, or the copies overflow. q is 2^-16 so the scores
/// stay as they were. The smallest variant and the 32-row prefetching one.
#[test]
fn flash_scales_operands_beyond_f16_range() {
    let (l, d) = (150, 64);
    // `seed`'s values times `by(row, column)`
    let scaled = |seed, shape: &[usize], by: &dyn Fn(usize, usize) -> f32| {
        let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        let x = random(DType::F32, shape, seed).to_f32_vec();
        let x: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, v)| v * by((i / cols) % rows, i % cols))
            .collect();
        Tensor::from_f32(DType::BF16, shape, &x).unwrap()
    };
    let big = |p: i32| 2f32.powi(p);
    OpCase::new(sdpa(true, None, true))
        .input(scaled(41, &[1, 4, l, d], &|_, _| big(-16)))
        .input(scaled(42, &[1, 2, l, d], &|r, _| {
            if r >= 140 {
                big(16)
            } else {
                1.0
            }
        }))
        .input(scaled(43, &[1, 2, l, d], &|r, c| {
            if r == l - 1 && c == 5 {
                big(20)
            } else {
                1.0
            }
        }))
        .check_coop_emulating(BF16_TOL, &[(CoopForm::Half16, 0), (CoopForm::Half16, 3)]);
}

/// The real 16×16 flash attention (not emulated), each of its variants
/// forced in turn, against the CPU kernels: on an adapter that offers the
/// form (NVIDIA through Vulkan) every case must run it; elsewhere (lavapipe)
/// the portable kernel runs, and must still be right. Blocks of several
/// subgroups, keys off the tiles, key splits, causal GQA, head dims 64 and
/// 128. (Its emulated form passed while the real one read every matrix two
/// halves off: a workgroup array's alignment, which only a real GPU shows.)
#[test]
fn flash_attention_on_real_tensor_cores_where_offered() {
    let offered = adapter_offers_coop();
    let (b, h) = (DType::BF16, DType::F16);
    let cases = [
        (sdpa(false, None, false), b, [4, 4, 150, 150, 64]),
        (sdpa(true, None, true), b, [8, 2, 256, 256, 64]),
        (sdpa(false, None, false), b, [1, 1, 64, 64, 64]),
        (sdpa(true, None, true), h, [4, 2, 130, 150, 128]),
    ];
    // the variants offered: at head dim 64 four 16-row tile shapes and
    // three of them prefetching, then three 32-row shapes and two
    // prefetching; at 128 the shapes within the workgroup memory (3 and 1,
    // 2 and 1)
    let variants = |d: usize| if d == 64 { 12 } else { 7 };
    for (op, dtype, [heads, kv, l, s, d]) in cases {
        let what = format!("{op:?} {dtype:?} {heads}/{kv} heads, {l}x{s}, d {d}");
        let seed = (heads * 1000 + l + s) as u64;
        let (graph, inputs) = OpCase::new(op)
            .input(random(dtype, &[1, heads, l, d], seed))
            .input(random(dtype, &[1, kv, s, d], seed + 1))
            .input(random(dtype, &[1, kv, s, d], seed + 2))
            .build();
        let expected = etmetal::eval::run_graph(&graph, inputs.clone()).unwrap();
        let pte = compile_whole(&graph);
        // (the 16×16 variants come first among the alternatives)
        for variant in 0..variants(d) {
            let gpu =
                Arc::new(MetalBackend::new(DeviceChoice::Auto).with_forced_alternative(variant));
            let mut method = load_method_on(gpu.clone(), &pte);
            assert_eq!(
                gpu.stats().alternatives_chosen,
                u64::from(offered),
                "{what}: variant {variant} runs where offered ({offered})"
            );
            let got = method.execute(inputs.clone()).unwrap();
            assert_close(
                &got[0],
                &expected[0],
                BF16_TOL,
                &format!("{what}: variant {variant}"),
            );
        }
    }
}

/// Masks on the tensor cores: an additive bf16 mask broadcast over heads,
/// and a bool mask with a row of no key (zeros, as the CPU kernel gives).
#[test]
fn attention_masks_on_emulated_tensor_cores() {
    let b = DType::BF16;
    OpCase::new(sdpa(false, None, false))
        .input(random(b, &[1, 4, 100, 64], 120))
        .input(random(b, &[1, 4, 90, 64], 121))
        .input(random(b, &[1, 4, 90, 64], 122))
        .input(random(b, &[1, 1, 100, 90], 123))
        .check_coop(BF16_TOL, BOTH);
    let (l, s) = (40, 130);
    let mut keep = random_indices(&[l, s], 2, 124).to_i64_vec();
    keep[3 * s..4 * s].iter_mut().for_each(|k| *k = 0);
    let mask = Tensor::from_i64(DType::Bool, &[l, s], &keep).unwrap();
    OpCase::new(sdpa(false, None, false))
        .input(random(b, &[2, 3, l, 64], 125))
        .input(random(b, &[2, 3, s, 64], 126))
        .input(random(b, &[2, 3, s, 64], 127))
        .input(mask)
        .check_coop(BF16_TOL, BOTH);
}

/// Causal GQA prefill over a run-time length (`torch.export.Dim`, bound
/// 128) on the emulated tensor-core kernels: each row bucket has its own,
/// over the row blocks of the actual length, keys ending at it (what lies
/// past it in the bound layout is never read into a valid row); one loaded
/// program at 100, 1, 17 and 64 tokens (the largest first: the smaller
/// runs find its keys past their own). Also as compiled (on lavapipe, the
/// portable kernel, whose keys end there too).
#[test]
fn dynamic_prefill_on_emulated_tensor_cores() {
    let b = DType::BF16;
    let case = |l: usize| {
        let seed = l as u64;
        OpCase::new(sdpa(true, None, true))
            .input(random(b, &[1, 4, l, 64], seed))
            .input(random(b, &[1, 2, l, 64], seed + 1))
            .input(random(b, &[1, 2, l, 64], seed + 2))
            .build()
    };
    let at = [(0, 2), (1, 2), (2, 2)];
    // (16×16: the smallest flash variant, and the 32-row prefetching one,
    // whose row buckets are blocks of 64 rows)
    for emulated in [
        None,
        Some((CoopForm::Half16, 0)),
        Some((CoopForm::Half16, 3)),
        Some((CoopForm::Float8, 0)),
    ] {
        let what = format!("dynamic causal prefill {emulated:?}");
        check_dynamic(case, &at, 128, &[100, 1, 17, 64], BF16_TOL, emulated, &what);
    }
}

#[test]
fn topk_largest_smallest_and_ties() {
    for (k, dim, largest) in [(3, 1, true), (1, 0, false), (5, 1, false), (12, 1, true)] {
        OpCase::new(Op::TopK {
            k,
            dim,
            largest,
            sorted: true,
        })
        .input(random(DType::F32, &[5, 12], 60 + k as u64))
        .check(0.0);
    }
    // many ties: lower indices first, as the CPU kernel
    let ties = random_indices(&[4, 3, 20], 4, 61).cast(DType::F32).unwrap();
    for largest in [true, false] {
        OpCase::new(Op::TopK {
            k: 7,
            dim: 2,
            largest,
            sorted: true,
        })
        .input(ties.clone())
        .check(0.0);
    }
    OpCase::new(Op::TopK {
        k: 2,
        dim: 0,
        largest: true,
        sorted: true,
    })
    .input_permuted(random(DType::BF16, &[3, 70, 2], 62), &[1, 2, 0])
    .check(0.0);
    // int64 and int32 values (an MoE router's sort of its expert ids, as
    // `torch.sort` exports it: top-k of every element), negatives and ties
    for dtype in [DType::I64, DType::I32] {
        let ids = Tensor::from_i64(
            dtype,
            &[2, 9],
            &[3, -7, 3, 0, 12, 5, 5, -1, 2, 9, 9, 1, 0, 4, 8, 2, 7, 6],
        )
        .unwrap();
        for largest in [true, false] {
            OpCase::new(Op::TopK {
                k: 9,
                dim: 1,
                largest,
                sorted: true,
            })
            .input(ids.clone())
            .check(0.0);
        }
    }
}

#[test]
fn topk_puts_nan_first_when_largest() {
    let x = Tensor::from_f32(
        DType::F32,
        &[2, 4],
        &[1.0, f32::NAN, -2.0, 3.0, -0.0, 0.0, f32::NEG_INFINITY, 0.0],
    )
    .unwrap();
    for largest in [true, false] {
        OpCase::new(Op::TopK {
            k: 3,
            dim: 1,
            largest,
            sorted: true,
        })
        .input(x.clone())
        .check(0.0);
    }
}

#[test]
fn cumsum_f32_bf16_and_long_rows() {
    OpCase::new(Op::CumSum { dim: 1 })
        .input(random(DType::F32, &[3, 7, 2], 70))
        .check(1e-5);
    OpCase::new(Op::CumSum { dim: 0 })
        .input(random(DType::F32, &[1000, 2], 71))
        .check(1e-4);
    OpCase::new(Op::CumSum { dim: 0 })
        .input_permuted(random(DType::BF16, &[4, 6], 73), &[1, 0])
        .check(BF16_TOL);
}

#[test]
fn advanced_indexing() {
    let x = random(DType::F32, &[4, 5, 6], 80);
    // one index tensor on dim 0
    OpCase::new(Op::Index)
        .input(x.clone())
        .input(ints(&[2, 3], &[0, 3, -1, 2, 2, 1]))
        .check(0.0);
    // adjacent indexed dims 1, 2 broadcast together; dim 0 kept
    OpCase::new(Op::Index)
        .input(x.clone())
        .absent()
        .input(ints(&[3, 1], &[4, 0, -2]))
        .input(ints(&[2], &[5, 1]))
        .check(0.0);
    // dims 0 and 2 (not adjacent): the broadcast dims come first
    OpCase::new(Op::Index)
        .input_permuted(x, &[2, 0, 1])
        .input(ints(&[3], &[5, 0, 2]))
        .absent()
        .input(ints(&[3], &[1, 4, 0]))
        .check(0.0);
    OpCase::new(Op::Index)
        .input(random_indices(&[7, 3], 100, 81))
        .input(ints(&[4], &[6, 0, 6, 3]))
        .check(0.0);
}
