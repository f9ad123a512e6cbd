//! A delegate's tensor inputs are lent from the method's planned memory;
//! one that shares bytes with an output is copied first, so the delegate
//! still reads the input's value while it writes its output.

use std::sync::Arc;

use etmetal_core::{DType, Result, Tensor};
use etmetal_pte::{
    BackendDelegate, BackendDelegateDataReference, BackendDelegateInlineData, Chain, CompileSpec,
    DataLocation, DelegateCall, EValue, ExecutionPlan, Instruction, Program as PteProgram,
};
use etmetal_runtime::{
    Backend, BackendRegistry, DelegateArg, DelegateHandle, LoadOptions, NamedData, Program,
};

/// `y = -x`, writing zeros into `y` before it reads `x`: an input aliasing
/// the output would read those zeros.
struct Negate;
struct NegateHandle;

impl Backend for Negate {
    fn id(&self) -> &str {
        "TestNegate"
    }
    fn init(
        &self,
        _processed: &[u8],
        _specs: &[CompileSpec],
        _named: &dyn NamedData,
    ) -> Result<Box<dyn DelegateHandle>> {
        Ok(Box::new(NegateHandle))
    }
}

impl DelegateHandle for NegateHandle {
    fn execute(&mut self, args: &mut [DelegateArg]) -> Result<()> {
        let [DelegateArg::Tensor(x), DelegateArg::Output(y)] = args else {
            panic!("expected a tensor and an output, got {args:?}");
        };
        y.bytes.fill(0);
        let neg: Vec<f32> = x
            .bytes
            .chunks_exact(4)
            .map(|c| -f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        y.bytes.copy_from_slice(bytemuck::cast_slice(&neg));
        Ok(())
    }

    fn output_count(&self) -> usize {
        1
    }
}

/// One delegate call `y = -x` over 5 floats, `y` planned at byte `y_at` of
/// the arena that holds `x` at 0.
fn negate_program(y_at: u32) -> Program {
    let tensor = |offset: u32| {
        EValue::Tensor(etmetal_pte::Tensor::planned(
            DType::F32,
            &[5],
            1,
            offset.into(),
        ))
    };
    let program = PteProgram {
        execution_plan: vec![ExecutionPlan {
            name: "forward".into(),
            values: vec![tensor(0), tensor(y_at)],
            inputs: vec![0],
            outputs: vec![1],
            chains: vec![Chain {
                inputs: vec![0],
                outputs: vec![1],
                instructions: vec![Instruction::DelegateCall(DelegateCall {
                    delegate_index: 0,
                    args: vec![0, 1],
                })],
                stacktrace: None,
            }],
            delegates: vec![BackendDelegate {
                id: "TestNegate".into(),
                processed: BackendDelegateDataReference {
                    location: DataLocation::Inline,
                    index: 0,
                },
                compile_specs: vec![],
            }],
            non_const_buffer_sizes: vec![0, 64],
            ..ExecutionPlan::default()
        }],
        backend_delegate_data: vec![BackendDelegateInlineData { data: vec![] }],
        ..PteProgram::default()
    };
    let bytes = etmetal_pte::serialize(&program, &[]).unwrap();
    let mut backends = BackendRegistry::new();
    backends.register(Arc::new(Negate)).unwrap();
    Program::from_bytes(&bytes)
        .unwrap()
        .with_options(LoadOptions {
            backends,
            ..LoadOptions::default()
        })
}

#[test]
fn inputs_are_lent_apart_from_outputs_and_copied_when_they_share_bytes() {
    let x = Tensor::from_f32(DType::F32, &[5], &[1.0, -2.0, 3.5, 0.0, 7.0]).unwrap();
    // apart (lent), in place (copied), and overlapping by one element
    for y_at in [32, 0, 16] {
        let mut method = negate_program(y_at).method("forward").unwrap();
        for _ in 0..2 {
            let y = method.execute(vec![x.clone()]).unwrap();
            assert_eq!(
                y[0].to_f32_vec(),
                [-1.0, 2.0, -3.5, -0.0, -7.0],
                "y at byte {y_at}"
            );
        }
    }
}
