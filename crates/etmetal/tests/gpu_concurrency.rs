//! One `.pte` compiled for the Metal backend, loaded once with a
//! `MetalBackend` registered, run from several threads: each thread makes
//! its own `Method` (its own delegate state: arenas, bind groups, read-back
//! buffer) on the one shared device. Outputs are correct, bit-identical
//! across executes, threads and processes, and executing does not grow
//! resident memory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use etmetal::compile::{compile, CompileOptions};
use etmetal_core::{npy, Tensor};
use etmetal_metal_runtime::{select_adapter, DeviceChoice, MetalBackend};
use etmetal_runtime::{BackendRegistry, LoadOptions, Program};

const THREADS: usize = 8;
/// 8 x 200 executes of mlp take about 3 s on lavapipe with 2 cores.
const EXECUTES: usize = 200;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// mlp.pt2 compiled with the Metal backend (default options).
fn mlp_pte() -> Vec<u8> {
    let graph = etmetal_graph::load_pt2(&fixture("mlp.pt2")).unwrap();
    let c = compile(&graph, &CompileOptions::default(), &mut |_| {}).unwrap();
    assert!(!c.partitions.is_empty(), "mlp: nothing went to the GPU");
    c.pte
}

fn backend() -> Arc<MetalBackend> {
    if let Err(e) = select_adapter(DeviceChoice::Auto) {
        panic!(
            "GPU tests need an adapter: {e}. On Debian/Ubuntu: \
             apt-get install mesa-vulkan-drivers libvulkan1 (Mesa lavapipe)"
        );
    }
    Arc::new(MetalBackend::new(DeviceChoice::Auto))
}

/// Resident memory of this process in pages (`/proc/self/statm`, field 2).
fn resident_pages() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Within the tolerance the GPU op tests use for float32.
fn assert_close(got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape());
    for (i, (a, b)) in got.to_f64_vec().iter().zip(want.to_f64_vec()).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 + 1e-4 * b.abs(),
            "[{i}]: GPU {a} vs {b}"
        );
    }
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
    // Every thread's first execute, then the main thread measures, then the rest.
    let first_done = Arc::new(Barrier::new(THREADS + 1));
    let measured = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|_| {
            let (program, input) = (program.clone(), input.clone());
            let (first_done, measured) = (first_done.clone(), measured.clone());
            std::thread::spawn(move || {
                let mut method = program.method("forward").unwrap();
                let first = method.execute(vec![input.clone()]).unwrap();
                first_done.wait();
                measured.wait();
                for _ in 1..EXECUTES {
                    let out = method.execute(vec![input.clone()]).unwrap();
                    assert_eq!(out.len(), 1);
                    assert_eq!(
                        out[0].bytes(),
                        first[0].bytes(),
                        "outputs differ between executes"
                    );
                }
                first
            })
        })
        .collect();
    first_done.wait();
    let after_first = resident_pages();
    let stats_first = gpu.stats();
    let start = Instant::now();
    measured.wait();
    let outputs: Vec<Vec<Tensor>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let seconds = start.elapsed().as_secs_f64();
    let after_all = resident_pages();
    eprintln!(
        "{THREADS} threads x {} executes in {seconds:.2} s; resident {after_first} -> {after_all} pages",
        EXECUTES - 1
    );
    for out in &outputs {
        assert_close(&out[0], &expected);
        assert_eq!(out[0].bytes(), outputs[0][0].bytes(), "threads disagree");
    }
    // One delegate a method, all on one device; executes make no GPU objects.
    let stats = gpu.stats();
    assert_eq!(stats.pipelines_created, stats_first.pipelines_created);
    assert_eq!(stats.buffers_allocated, stats_first.buffers_allocated);
    assert_eq!(
        stats.submits - stats_first.submits,
        (THREADS * (EXECUTES - 1)) as u64
    );
    // 10%, plus 2 MiB of 4 KiB pages for allocator arenas of the 8 threads
    // and the test harness's own buffers, which move by a few hundred KiB.
    let slack = after_first / 10 + 512;
    assert!(
        after_all <= after_first + slack,
        "resident memory grew from {after_first} to {after_all} pages over {} executes",
        THREADS * EXECUTES
    );
}

#[test]
fn two_processes_write_the_same_gpu_output_bytes() {
    let dir = std::env::temp_dir().join(format!("etmetal-gpu-determinism-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pte = dir.join("mlp.pte");
    std::fs::write(&pte, mlp_pte()).unwrap();
    let run = |name: &str| {
        let out = dir.join(name);
        let res = Command::new(env!("CARGO_BIN_EXE_etmetal"))
            .arg("run")
            .arg(&pte)
            .arg("--inputs")
            .arg(fixture("mlp.input_0.npy"))
            .arg("--output-dir")
            .arg(&out)
            .args(["--device", "vulkan"])
            .output()
            .unwrap();
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        std::fs::read(out.join("output_0.npy")).unwrap()
    };
    let (a, b) = (run("a"), run("b"));
    assert_eq!(a, b, "two processes wrote different GPU outputs");
    let got = npy::read(&dir.join("a/output_0.npy")).unwrap();
    assert_close(&got, &npy::read(&fixture("mlp.output_0.npy")).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}
