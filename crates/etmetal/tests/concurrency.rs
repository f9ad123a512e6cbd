//! One loaded `.pte` program (CPU kernels) shared by threads, each with its
//! own method: correct outputs, bit-identical across executes, threads and
//! processes, and no memory growth from executing.

mod common;

use std::sync::Arc;

use common::gpu::assert_close;
use common::threads::{assert_flat_memory, fixture, hammer, two_processes};
use etmetal_core::npy;
use etmetal_runtime::Program;

fn mlp_pte() -> Vec<u8> {
    etmetal::compile::compile_pt2_cpu(&fixture("mlp.pt2")).unwrap()
}

#[test]
fn program_is_send_and_sync_and_method_is_send() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Program>();
    send::<etmetal_runtime::Method>();
}

#[test]
fn threads_share_one_program_with_correct_bit_identical_outputs_and_flat_memory() {
    let program = Arc::new(Program::from_bytes(&mlp_pte()).unwrap());
    let input = npy::read(&fixture("mlp.input_0.npy")).unwrap();
    let expected = npy::read(&fixture("mlp.output_0.npy")).unwrap();
    let h = hammer(program, &input, &mut || {});
    for out in &h.outputs {
        assert_close(&out[0], &expected, 1e-5, "mlp on the cpu");
    }
    assert_flat_memory(&h);
}

#[test]
fn two_processes_write_the_same_output_bytes() {
    let (a, b) = two_processes(&mlp_pte(), "cpu");
    assert!(!a.is_empty());
    assert_eq!(a, b, "two runs wrote different output_0.npy bytes");
}
