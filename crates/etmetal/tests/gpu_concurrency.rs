//! One `.pte` compiled for the Metal backend, loaded once with a
//! `MetalBackend` registered, run from several threads: each thread makes
//! its own `Method` (its own delegate state: arenas, bind groups, read-back
//! buffer) on the one shared device. Outputs are correct, bit-identical
//! across executes, threads and processes, and executing does not grow
//! resident memory.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::gpu::{assert_close, backend};
use common::threads::{assert_flat_memory, fixture, hammer, two_processes, EXECUTES, THREADS};
use etmetal::compile::{compile, CompileOptions};
use etmetal_core::npy;
use etmetal_runtime::{BackendRegistry, LoadOptions, Program};

/// mlp.pt2 compiled with the Metal backend (default options).
fn mlp_pte() -> Vec<u8> {
    let graph = etmetal_graph::load_pt2(&fixture("mlp.pt2")).unwrap();
    let c = compile(&graph, &CompileOptions::default(), &mut |_| {}).unwrap();
    assert!(
        !c.methods[0].partitions.is_empty(),
        "mlp: nothing went to the GPU"
    );
    c.pte
}

#[test]
fn threads_with_their_own_gpu_methods_on_one_device_agree_and_do_not_grow_memory() {
    let gpu = backend();
    let mut backends = BackendRegistry::new();
    backends.register(gpu.clone()).unwrap();
    let program = Arc::new(
        Program::from_bytes(&mlp_pte())
            .unwrap()
            .with_options(LoadOptions {
                backends,
                ..LoadOptions::default()
            }),
    );
    let input = npy::read(&fixture("mlp.input_0.npy")).unwrap();
    let expected = npy::read(&fixture("mlp.output_0.npy")).unwrap();
    let mut stats_first = None;
    let start = Instant::now();
    let h = hammer(program, &input, &mut || stats_first = Some(gpu.stats()));
    eprintln!(
        "{THREADS} threads x {EXECUTES} executes in {:.2} s; resident {} -> {} pages",
        start.elapsed().as_secs_f64(),
        h.after_first,
        h.after_all
    );
    for out in &h.outputs {
        assert_close(&out[0], &expected, 1e-4, "mlp on the GPU");
    }
    // One delegate a method, all on one device; executes make no GPU objects.
    let (stats_first, stats) = (stats_first.unwrap(), gpu.stats());
    assert_eq!(stats.pipelines_created, stats_first.pipelines_created);
    assert_eq!(stats.buffers_allocated, stats_first.buffers_allocated);
    assert_eq!(
        stats.submits - stats_first.submits,
        (THREADS * (EXECUTES - 1)) as u64
    );
    assert_flat_memory(&h);
}

#[test]
fn two_processes_write_the_same_gpu_output_bytes() {
    let (a, b) = two_processes(&mlp_pte(), "vulkan");
    assert!(!a.is_empty());
    assert_eq!(a, b, "two processes wrote different GPU outputs");
}
