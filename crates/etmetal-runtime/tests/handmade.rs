//! Programs built by hand: aliasing planned memory, in-place calls, moves and
//! jumps, scalar operands, unwritten statistics outputs, unknown operators.

use etmetal_core::{DType, ErrorKind, Tensor};
use etmetal_pte::{
    Chain, EValue, ExecutionPlan, FreeCall, Instruction, JumpFalseCall, KernelCall, MoveCall,
    Operator, Program as Fb,
};
use etmetal_runtime::Program;

/// A planned tensor at `offset` of memory 1.
fn planned(dtype: DType, sizes: &[i32], offset: u32) -> EValue {
    EValue::Tensor(etmetal_pte::Tensor::planned(dtype, sizes, 1, offset.into()))
}

fn kernel(op_index: i32, args: &[i32]) -> Instruction {
    Instruction::KernelCall(KernelCall {
        op_index,
        args: args.to_vec(),
    })
}

fn ops(names: &[&str]) -> Vec<Operator> {
    names
        .iter()
        .map(|n| {
            let (name, overload) = n.split_once('.').unwrap();
            Operator {
                name: name.into(),
                overload: overload.into(),
            }
        })
        .collect()
}

fn build(
    values: Vec<EValue>,
    operators: Vec<Operator>,
    instructions: Vec<Instruction>,
    io: (&[i32], &[i32]),
) -> Program {
    let plan = ExecutionPlan {
        name: "forward".into(),
        values,
        inputs: io.0.to_vec(),
        outputs: io.1.to_vec(),
        chains: vec![Chain {
            inputs: io.0.to_vec(),
            outputs: io.1.to_vec(),
            instructions,
            stacktrace: None,
        }],
        operators,
        non_const_buffer_sizes: vec![0, 256],
        ..ExecutionPlan::default()
    };
    let program = Fb {
        execution_plan: vec![plan],
        ..Fb::default()
    };
    Program::from_bytes(&etmetal_pte::serialize(&program, &[]).unwrap()).unwrap()
}

/// `y = relu(layer_norm(x))` over [2, 4]; value 9 is a [8] view sharing y's bytes.
fn layer_norm_program(relu_reads: i32) -> Program {
    let values = vec![
        planned(DType::F32, &[2, 4], 0),   // 0 x
        EValue::Int(4),                    // 1
        EValue::IntList(vec![1]),          // 2 normalized_shape
        EValue::Null,                      // 3 weight, bias
        EValue::Double(1e-5),              // 4 eps
        planned(DType::F32, &[2, 4], 32),  // 5 out0
        planned(DType::F32, &[2, 1], 64),  // 6 mean
        planned(DType::F32, &[2, 1], 72),  // 7 rstd
        planned(DType::F32, &[2, 4], 80),  // 8 y
        planned(DType::F32, &[8], 80),     // 9 view of y
        EValue::TensorList(vec![5, 6, 7]), // 10
        planned(DType::F32, &[2, 1], 112), // 11 relu of a statistic
    ];
    let relu_out = if relu_reads == 5 { 8 } else { 11 };
    build(
        values,
        ops(&["aten::native_layer_norm.out", "aten::relu.out"]),
        vec![
            kernel(0, &[0, 2, 3, 3, 4, 5, 6, 7, 10]),
            kernel(1, &[relu_reads, relu_out, relu_out]),
        ],
        (&[0], &[8, 9]),
    )
}

#[test]
fn views_alias_planned_memory() {
    let mut m = layer_norm_program(5).method("forward").unwrap();
    let x = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.0, 1.0, 6.0];
    let out = m
        .execute(vec![Tensor::from_f32(DType::F32, &[2, 4], &x).unwrap()])
        .unwrap();
    let mut want = Vec::new();
    for row in x.chunks(4) {
        let mean = row.iter().sum::<f32>() / 4.0;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / 4.0;
        want.extend(
            row.iter()
                .map(|v| ((v - mean) / (var + 1e-5).sqrt()).max(0.0)),
        );
    }
    let got = out[0].to_f32_vec();
    assert!(
        got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5),
        "{got:?} vs {want:?}"
    );
    assert_eq!(out[1].shape(), &[8]);
    assert_eq!(out[1].to_f32_vec(), got, "the view reads y's bytes");
}

#[test]
fn reading_an_uncomputed_statistic_is_refused_at_load() {
    let e = layer_norm_program(6).method("forward").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(
        msg.contains("instruction 1 reads value 6") && msg.contains("native_layer_norm"),
        "{msg}"
    );
}

#[test]
fn unknown_operator_names_itself_and_the_instruction() {
    let values = vec![planned(DType::F32, &[3], 0), planned(DType::F32, &[3], 16)];
    let p = build(
        values,
        ops(&["aten::relu.out", "aten::frobnicate.out"]),
        vec![kernel(0, &[0, 1, 1]), kernel(1, &[1, 1, 1])],
        (&[0], &[1]),
    );
    let e = p.method("forward").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(
        msg.contains("instruction 1") && msg.contains("aten::frobnicate.out"),
        "{msg}"
    );
}

/// `y = x; if cond { y = relu(y) (in place) }; free(y)`.
fn move_jump_program(cond: bool) -> Program {
    let values = vec![
        planned(DType::F32, &[3], 0),
        planned(DType::F32, &[3], 16),
        EValue::Bool(cond),
    ];
    build(
        values,
        ops(&["aten::relu.out"]),
        vec![
            Instruction::MoveCall(MoveCall {
                move_from: 0,
                move_to: 1,
            }),
            Instruction::JumpFalseCall(JumpFalseCall {
                cond_value_index: 2,
                destination_instruction: 3,
            }),
            kernel(0, &[1, 1, 1]),
            Instruction::FreeCall(FreeCall { value_index: 1 }),
        ],
        (&[0], &[1]),
    )
}

#[test]
fn moves_jumps_and_in_place_calls() {
    let x = Tensor::from_f32(DType::F32, &[3], &[-1.0, 2.0, -3.0]).unwrap();
    let out = move_jump_program(false)
        .method("forward")
        .unwrap()
        .execute(vec![x.clone()])
        .unwrap();
    assert_eq!(out[0].to_f32_vec(), vec![-1.0, 2.0, -3.0]);
    let out = move_jump_program(true)
        .method("forward")
        .unwrap()
        .execute(vec![x])
        .unwrap();
    assert_eq!(out[0].to_f32_vec(), vec![0.0, 2.0, 0.0]);
}

/// A kernel whose output partly overlaps its input reads the input as it
/// was, as one that writes a separate output does.
#[test]
fn partly_overlapping_output_reads_the_inputs_first() {
    for out_offset in [8, 32] {
        let values = vec![
            planned(DType::F32, &[4], 0),
            planned(DType::F32, &[4], out_offset),
            EValue::Int(1),
        ];
        let p = build(
            values,
            ops(&["aten::add.out"]),
            vec![kernel(0, &[0, 0, 2, 1, 1])],
            (&[0], &[1]),
        );
        let x = Tensor::from_f32(DType::F32, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let out = p.method("forward").unwrap().execute(vec![x]).unwrap();
        assert_eq!(
            out[0].to_f32_vec(),
            vec![2.0, 4.0, 6.0, 8.0],
            "offset {out_offset}"
        );
    }
}

/// `y = relu(x); y.copy_(y)`: a write-back planned onto its own bytes.
#[test]
fn copy_onto_itself_keeps_the_value() {
    let values = vec![
        planned(DType::F32, &[3], 0),
        planned(DType::F32, &[3], 16),
        EValue::Bool(false),
    ];
    let p = build(
        values,
        ops(&["aten::relu.out", "aten::copy_."]),
        vec![kernel(0, &[0, 1, 1]), kernel(1, &[1, 1, 2, 1])],
        (&[0], &[1]),
    );
    let x = Tensor::from_f32(DType::F32, &[3], &[-1.0, 2.0, 3.0]).unwrap();
    let out = p.method("forward").unwrap().execute(vec![x]).unwrap();
    assert_eq!(out[0].to_f32_vec(), vec![0.0, 2.0, 3.0]);
}

#[test]
fn scalar_operands_follow_pytorch_promotion() {
    let values = vec![
        planned(DType::I64, &[3], 0),
        EValue::Double(0.5),
        planned(DType::F32, &[3], 32),
        EValue::Int(1),
        planned(DType::Bool, &[3], 48),
    ];
    let p = build(
        values,
        ops(&["aten::mul.Scalar_out", "aten::gt.Scalar_out"]),
        vec![kernel(0, &[0, 1, 2, 2]), kernel(1, &[0, 3, 4, 4])],
        (&[0], &[2, 4]),
    );
    let x = Tensor::from_i64(DType::I64, &[3], &[1, 2, 3]).unwrap();
    let out = p.method("forward").unwrap().execute(vec![x]).unwrap();
    assert_eq!(out[0].to_f32_vec(), vec![0.5, 1.0, 1.5]);
    assert_eq!(out[1].dtype(), DType::Bool);
    assert_eq!(out[1].to_i64_vec(), vec![0, 1, 1]);
}

#[test]
fn float32_for_a_bf16_input_is_rounded() {
    let values = vec![
        planned(DType::BF16, &[2], 0),
        planned(DType::BF16, &[2], 16),
    ];
    let p = build(
        values,
        ops(&["aten::relu.out"]),
        vec![kernel(0, &[0, 1, 1])],
        (&[0], &[1]),
    );
    let mut m = p.method("forward").unwrap();
    // 1 + 2^-8 lies halfway between bf16 neighbours and rounds to even (1.0).
    let x = Tensor::from_f32(DType::F32, &[2], &[1.0 + 1.0 / 256.0, -2.0]).unwrap();
    let out = m.execute(vec![x]).unwrap();
    assert_eq!(out[0].dtype(), DType::BF16);
    assert_eq!(out[0].to_f32_vec(), vec![1.0, 0.0]);
    let e = m
        .execute(vec![Tensor::zeros(DType::F64, &[2]).unwrap()])
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("expected bfloat16 [2], got float64 [2]"),
        "{e}"
    );
}
