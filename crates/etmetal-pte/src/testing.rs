//! Test support for the runtime crates (feature `testing`): the program
//! their tests build by hand around one delegate.

use crate::{
    BackendDelegate, BackendDelegateDataReference, BackendDelegateInlineData, Chain, DataLocation,
    DelegateCall, EValue, ExecutionPlan, Instruction, Program, Tensor,
};

/// A program whose method `forward` is one call of the delegate `id`
/// (`processed` stored inline as its data) from `input` (value 0) to
/// `output` (value 1), both planned in memory 1; memory 1 holds them both,
/// rounded up to 64 bytes (a cache line). Tests add named data, kernels
/// or values to it before [`crate::serialize`].
pub fn one_delegate_call(id: &str, processed: Vec<u8>, input: Tensor, output: Tensor) -> Program {
    let end = |t: &Tensor| {
        let at = t.allocation_info.map_or(0, |a| a.memory_offset());
        let numel: u64 = t.sizes.iter().map(|&s| s.max(0) as u64).product();
        at + numel * t.scalar_type.size() as u64
    };
    let memory = end(&input).max(end(&output)).next_multiple_of(64) as i64;
    Program {
        execution_plan: vec![ExecutionPlan {
            name: "forward".into(),
            values: vec![EValue::Tensor(input), EValue::Tensor(output)],
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
                id: id.into(),
                processed: BackendDelegateDataReference {
                    location: DataLocation::Inline,
                    index: 0,
                },
                compile_specs: vec![],
            }],
            non_const_buffer_sizes: vec![0, memory],
            ..ExecutionPlan::default()
        }],
        backend_delegate_data: vec![BackendDelegateInlineData { data: processed }],
        ..Program::default()
    }
}
