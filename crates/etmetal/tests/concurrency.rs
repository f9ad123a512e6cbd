//! One loaded `.pte` program shared by threads, each with its own method:
//! correct outputs, bit-identical across executes, threads and processes,
//! and no memory growth from executing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};

use etmetal_core::{npy, Tensor};
use etmetal_runtime::Program;

const THREADS: usize = 8;
const EXECUTES: usize = 200;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn mlp_pte() -> Vec<u8> {
    etmetal::compile::compile_pt2_cpu(&fixture("mlp.pt2")).unwrap()
}

/// Resident memory of this process in pages (`/proc/self/statm`, field 2).
fn resident_pages() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Within the tolerance tests/fixtures use for float32 (atol = rtol = 1e-5).
fn assert_close(got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape());
    for (i, (a, b)) in got.to_f64_vec().iter().zip(want.to_f64_vec()).enumerate() {
        assert!((a - b).abs() <= 1e-5 + 1e-5 * b.abs(), "[{i}]: {a} vs {b}");
    }
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
    measured.wait();
    let outputs: Vec<Vec<Tensor>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let after_all = resident_pages();
    for out in &outputs {
        assert_close(&out[0], &expected);
        assert_eq!(out[0].bytes(), outputs[0][0].bytes(), "threads disagree");
    }
    // 10%, plus 2 MiB of 4 KiB pages for allocator arenas and the test
    // harness's own buffers, which move by a few hundred KiB run to run.
    let slack = after_first / 10 + 512;
    assert!(
        after_all <= after_first + slack,
        "resident memory grew from {after_first} to {after_all} pages over {} executes",
        THREADS * EXECUTES
    );
}

#[test]
fn two_processes_write_the_same_output_bytes() {
    let dir = std::env::temp_dir().join(format!("etmetal-determinism-{}", std::process::id()));
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
            .args(["--device", "cpu"])
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
    assert!(!a.is_empty());
    assert_eq!(a, b, "two runs wrote different output_0.npy bytes");
    let _ = std::fs::remove_dir_all(&dir);
}
