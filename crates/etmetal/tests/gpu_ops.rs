//! GPU kernels of the lead's templates (pointwise fusion, layout folding,
//! reductions, softmax) against the CPU kernels, on this machine's adapter.

mod common;

use common::gpu::{random, random_indices, OpCase};
use etmetal_core::{BinaryOp, DType, Op, ReduceOp, Scalar, UnaryOp};

const TOL: f32 = 1e-5;

#[test]
fn unary_ops_f32_bf16_f16() {
    for (k, u) in [
        UnaryOp::Relu,
        UnaryOp::Gelu { tanh: false },
        UnaryOp::Gelu { tanh: true },
        UnaryOp::Silu,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
        UnaryOp::Exp,
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Erf,
        UnaryOp::Round,
        UnaryOp::Hardswish,
        UnaryOp::Clamp {
            min: Some(-0.5),
            max: Some(0.25),
        },
        UnaryOp::PowScalar { exponent: 3.0 },
    ]
    .into_iter()
    .enumerate()
    {
        OpCase::new(Op::Unary(u))
            .input(random(DType::F32, &[3, 17], k as u64))
            .check(TOL);
        OpCase::new(Op::Unary(u))
            .input(random(DType::BF16, &[5, 3], k as u64))
            .check(1e-2);
        OpCase::new(Op::Unary(u))
            .input(random(DType::F16, &[7], k as u64))
            .check(1e-3);
    }
}

#[test]
fn broadcast_binary_ops_on_permuted_inputs() {
    for (k, b) in [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::Remainder,
        BinaryOp::Lt,
    ]
    .into_iter()
    .enumerate()
    {
        OpCase::new(Op::Binary(b))
            .input_permuted(random(DType::F32, &[5, 1, 3], k as u64), &[1, 2, 0])
            .input(random(DType::F32, &[4, 1, 1], 100 + k as u64))
            .check(TOL);
    }
}

#[test]
fn integer_and_bool_pointwise() {
    let a = random_indices(&[2, 7], 9, 1).cast(DType::I32).unwrap();
    let b = random_indices(&[7], 4, 2).cast(DType::I32).unwrap();
    OpCase::new(Op::Binary(BinaryOp::Add))
        .input(a.clone())
        .input(b.clone())
        .check(0.0);
    OpCase::new(Op::Binary(BinaryOp::Eq))
        .input(a.clone())
        .input(b)
        .check(0.0);
    OpCase::new(Op::Cast { dtype: DType::F32 })
        .input(a)
        .check(0.0);
}

#[test]
fn layout_ops_fold_into_reads() {
    let x = random(DType::F32, &[2, 6, 4], 7);
    OpCase::new(Op::Reshape {
        shape: vec![4, 3, 4],
    })
    .input_permuted(x.clone(), &[1, 0, 2])
    .check(0.0);
    OpCase::new(Op::Slice {
        dim: 1,
        start: 1,
        end: 6,
        step: 2,
    })
    .input(x.clone())
    .check(0.0);
    OpCase::new(Op::Select { dim: 2, index: 3 })
        .input(x.clone())
        .check(0.0);
    OpCase::new(Op::Expand {
        shape: vec![3, 2, 6, 4],
    })
    .input(x.clone())
    .check(0.0);
    OpCase::new(Op::Cat { dim: 1 })
        .input(x.clone())
        .input(random(DType::F32, &[2, 3, 4], 8))
        .check(0.0);
    OpCase::new(Op::ConstantPad {
        pad: vec![1, 2, -1, 0],
        value: 0.5,
    })
    .input(x.clone())
    .check(0.0);
    // padding only after a dim's end, in the middle and last dims (Swin's
    // `F.pad(x, [0, 0, 0, 1])`): the new rows are the fill value
    for pad in [vec![0, 0, 0, 1], vec![0, 2], vec![0, 1, 0, 0, 0, 2]] {
        OpCase::new(Op::ConstantPad { pad, value: -1.5 })
            .input(x.clone())
            .check(0.0);
    }
    OpCase::new(Op::Triangle {
        upper: false,
        diagonal: 1,
    })
    .input(x.clone())
    .check(0.0);
    OpCase::new(Op::Embedding)
        .weight(random(DType::F32, &[10, 4], 9))
        .input(random_indices(&[2, 3], 10, 3))
        .check(0.0);
    OpCase::new(Op::Arange {
        start: Scalar::Int(2),
        end: Scalar::Int(11),
        step: Scalar::Int(3),
        dtype: DType::I64,
    })
    .check(0.0);
}

#[test]
fn reductions_over_any_dims() {
    let x = random(DType::F32, &[3, 70, 5], 11);
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
        for dims in [vec![1], vec![0, 2], vec![]] {
            OpCase::new(Op::Reduce {
                op,
                dims,
                keepdim: false,
            })
            .input_permuted(x.clone(), &[2, 1, 0])
            .check(1e-5);
        }
    }
    OpCase::new(Op::Var {
        dims: vec![1],
        correction: 1.0,
        keepdim: true,
    })
    .input(x.clone())
    .check(1e-5);
    OpCase::new(Op::ArgReduce {
        max: true,
        dim: Some(1),
        keepdim: false,
    })
    .input(x.clone())
    .check(0.0);
    OpCase::new(Op::ReduceWithIndices {
        max: false,
        dim: 2,
        keepdim: true,
    })
    .input(x.clone())
    .check(0.0);
}

#[test]
fn nan_wins_max_min_and_arg_reductions() {
    let mut values = random(DType::F32, &[3, 70], 21).to_f32_vec();
    values[5] = f32::NAN;
    values[70 + 69] = f32::NAN;
    values[140 + 3] = f32::NAN;
    values[140 + 40] = f32::NAN;
    let x = etmetal_core::Tensor::from_f32(DType::F32, &[3, 70], &values).unwrap();
    for op in [ReduceOp::Max, ReduceOp::Min] {
        OpCase::new(Op::Reduce {
            op,
            dims: vec![1],
            keepdim: false,
        })
        .input(x.clone())
        .check(0.0);
    }
    for max in [true, false] {
        OpCase::new(Op::ArgReduce {
            max,
            dim: Some(1),
            keepdim: false,
        })
        .input(x.clone())
        .check(0.0);
    }
}

#[test]
fn softmax_and_log_softmax() {
    let x = random(DType::F32, &[4, 3, 129], 12);
    for (dim, log) in [(2, false), (1, true), (0, false)] {
        OpCase::new(Op::Softmax { dim, log })
            .input(x.clone())
            .check(1e-5);
    }
    OpCase::new(Op::Softmax { dim: 1, log: false })
        .input(random(DType::BF16, &[2, 33], 13))
        .check(1e-2);
}
