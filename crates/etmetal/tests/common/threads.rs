//! Harness of the concurrency and determinism tests: one loaded program
//! hammered from threads (one `Method` each), and the CLI run in two
//! processes. Used with the CPU and the GPU path alike.
#![allow(dead_code)] // each test file uses part of it

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};

use etmetal_core::Tensor;
use etmetal_runtime::Program;

pub const THREADS: usize = 8;
/// 8 × 200 executes of mlp take well under a second on the CPU and a few
/// seconds on lavapipe with 2 cores.
pub const EXECUTES: usize = 200;

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Resident memory of this process in pages (`/proc/self/statm`, field 2).
pub fn resident_pages() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse().unwrap()
}

pub struct Hammered {
    /// Each thread's output of its first execute.
    pub outputs: Vec<Vec<Tensor>>,
    pub after_first: u64,
    pub after_all: u64,
}

/// [`THREADS`] threads, each with its own method of `program`, execute
/// `input` [`EXECUTES`] times; every execute of a thread must give the same
/// bytes. `at_first` runs once every thread has done its first execute
/// (resident memory is measured then, and again at the end).
pub fn hammer(program: Arc<Program>, input: &Tensor, at_first: &mut dyn FnMut()) -> Hammered {
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
                    assert_eq!(out.len(), first.len());
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
    at_first();
    measured.wait();
    let outputs: Vec<Vec<Tensor>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let after_all = resident_pages();
    for out in &outputs {
        assert_eq!(out[0].bytes(), outputs[0][0].bytes(), "threads disagree");
    }
    Hammered {
        outputs,
        after_first,
        after_all,
    }
}

/// Executing did not grow resident memory: within 10%, plus 2 MiB of 4 KiB
/// pages for the threads' allocator arenas and the test harness's own
/// buffers, which move by a few hundred KiB run to run.
pub fn assert_flat_memory(h: &Hammered) {
    let slack = h.after_first / 10 + 512;
    assert!(
        h.after_all <= h.after_first + slack,
        "resident memory grew from {} to {} pages over {} executes",
        h.after_first,
        h.after_all,
        THREADS * EXECUTES
    );
}

/// `etmetal run PTE --device DEVICE` on mlp's input in two processes: the
/// bytes of each one's `output_0.npy`.
pub fn two_processes(pte: &[u8], device: &str) -> (Vec<u8>, Vec<u8>) {
    let dir = std::env::temp_dir().join(format!(
        "etmetal-determinism-{device}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.pte");
    std::fs::write(&file, pte).unwrap();
    let run = |name: &str| {
        let out = dir.join(name);
        let res = Command::new(env!("CARGO_BIN_EXE_etmetal"))
            .arg("run")
            .arg(&file)
            .arg("--inputs")
            .arg(fixture("mlp.input_0.npy"))
            .arg("--output-dir")
            .arg(&out)
            .args(["--device", device])
            .output()
            .unwrap();
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        std::fs::read(out.join("output_0.npy")).unwrap()
    };
    let outputs = (run("a"), run("b"));
    let _ = std::fs::remove_dir_all(&dir);
    outputs
}
