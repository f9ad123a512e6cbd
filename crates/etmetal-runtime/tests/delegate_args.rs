//! A delegate's tensor inputs are lent from the method's planned memory;
//! one that shares bytes with an output is copied first, so the delegate
//! still reads the input's value while it writes its output. A method
//! without CPU kernels runs its delegates on the caller's thread.

use std::sync::{Arc, Mutex};

use etmetal_core::{DType, Result, Tensor};
use etmetal_pte::testing::one_delegate_call;
use etmetal_pte::{CompileSpec, Instruction, KernelCall, Operator, Program as PteProgram};
use etmetal_runtime::{
    Backend, BackendRegistry, DelegateArg, DelegateHandle, LoadOptions, NamedData, Program,
};

/// `y = -x`, writing zeros into `y` before it reads `x`: an input aliasing
/// the output would read those zeros.
#[derive(Default)]
struct Negate {
    /// Per execute, the rayon worker it ran on (`None`: off the pool).
    ran_on: Arc<Mutex<Vec<Option<usize>>>>,
}
struct NegateHandle {
    ran_on: Arc<Mutex<Vec<Option<usize>>>>,
}

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
        Ok(Box::new(NegateHandle {
            ran_on: self.ran_on.clone(),
        }))
    }
}

impl DelegateHandle for NegateHandle {
    fn execute(&mut self, args: &mut [DelegateArg]) -> Result<()> {
        self.ran_on
            .lock()
            .unwrap()
            .push(rayon::current_thread_index());
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
fn negate_program(y_at: u32) -> PteProgram {
    let tensor = |offset: u32| etmetal_pte::Tensor::planned(DType::F32, &[5], 1, offset.into());
    one_delegate_call("TestNegate", vec![], tensor(0), tensor(y_at))
}

/// `program` loaded with `negate` as its one backend.
fn load(program: &PteProgram, negate: Arc<Negate>) -> Program {
    let bytes = etmetal_pte::serialize(program, &[]).unwrap();
    let mut backends = BackendRegistry::new();
    backends.register(negate).unwrap();
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
        let program = load(&negate_program(y_at), Arc::default());
        let mut method = program.method("forward").unwrap();
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

#[test]
fn a_method_of_delegate_calls_alone_runs_on_the_callers_thread() {
    // rayon's pool serves CPU kernels' parallel loops; entering it costs a
    // GPU delegate's execute two thread wake-ups, tens of µs
    let x = Tensor::from_f32(DType::F32, &[5], &[1.0, -2.0, 3.5, 0.0, 7.0]).unwrap();
    let alone = negate_program(32);
    // relu(x) in place, on the CPU, before the delegate negates it
    let mut after_relu = negate_program(32);
    let plan = &mut after_relu.execution_plan[0];
    plan.operators.push(Operator {
        name: "aten::relu".into(),
        overload: "out".into(),
    });
    plan.chains[0].instructions.insert(
        0,
        Instruction::KernelCall(KernelCall {
            op_index: 0,
            args: vec![0, 0, 0],
        }),
    );
    let cases = [
        (alone, [-1.0, 2.0, -3.5, -0.0, -7.0], false),
        (after_relu, [-1.0, 0.0, -3.5, 0.0, -7.0], true),
    ];
    for (program, want, in_pool) in cases {
        let negate = Arc::new(Negate::default());
        let mut method = load(&program, negate.clone()).method("forward").unwrap();
        let y = method.execute(vec![x.clone()]).unwrap();
        assert_eq!(y[0].to_f32_vec(), want);
        let ran_on = negate.ran_on.lock().unwrap().clone();
        assert_eq!(ran_on.len(), 1);
        assert_eq!(
            ran_on[0].is_some(),
            in_pool,
            "with a CPU kernel: {in_pool}, ran on rayon worker {:?}",
            ran_on[0]
        );
    }
}
