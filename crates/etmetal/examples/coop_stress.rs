//! Reproducer for the shader-compiler crash seen on the H200 with
//! tensor-core kernels (README, Tensor cores): the `gpu_matmul` test
//! binary, run multi-threaded, died inside NVIDIA's compiler in 2 of 3
//! runs. Each hypothesis below builds the same kernels in one pattern, so
//! the pattern that crashes names the cause. `scripts/coop_crash.sh` runs
//! them all.
//!
//! ```text
//! coop_stress list                      the adapter's offer and the cases
//! coop_stress kernel  [--rounds R] [--case NAME]
//!     one thread, one device: each case loaded R times in turn (one kernel
//!     at a time: a kernel that crashes the compiler alone shows here)
//! coop_stress threads [--threads T] [--rounds R]
//!     one device, T threads loading the cases at once (concurrent builds)
//! coop_stress churn   [--threads T] [--rounds R]
//!     one thread loading the cases while T-1 threads open instances,
//!     adapters and devices and drop them, building nothing
//! ```
//!
//! Every load builds its pipelines anew (the payload's kernels are compiled
//! at load) and runs once. Before each load a line `begin HYP CASE thread
//! T round R` goes to stderr, so a crash's last lines say what was being
//! built. NVIDIA's driver keeps compiled shaders on disk: run with
//! `__GL_SHADER_DISK_CACHE=0`, else later rounds skip the compiler.
//!
//! `cargo run --profile ci -p etmetal --example coop_stress -- list`

#[path = "../tests/common/gpu.rs"]
mod gpu;

use std::io::Write;
use std::sync::Arc;
use std::thread;

use etmetal_core::{ConvAttrs, DType, Op};
use etmetal_metal::payload::Requirements;
use etmetal_metal_runtime::{select_adapter, DeviceChoice, GpuDevice, MetalBackend};
use gpu::{compile_whole, load_method_on, random, OpCase};

const BF: DType = DType::BF16;
const H: DType = DType::F16;

/// One product of the `gpu_matmul` tensor-core tests (and one f32 product,
/// portable only), compiled: its name, `.pte` and inputs.
struct Case {
    name: &'static str,
    pte: Vec<u8>,
    inputs: Vec<etmetal_core::Tensor>,
}

fn cases() -> Vec<Case> {
    let mm = |dtype, m, k, n, seed| {
        OpCase::new(Op::MatMul)
            .input(random(dtype, &[m, k], seed))
            .input(random(dtype, &[k, n], seed + 1))
    };
    let conv = Op::Convolution(ConvAttrs {
        stride: vec![1, 1],
        padding: vec![1, 1],
        dilation: vec![1, 1],
        transposed: false,
        output_padding: vec![0, 0],
        groups: 1,
    });
    let list: Vec<(&'static str, OpCase)> = vec![
        ("mm_bf16_edges", mm(BF, 200, 72, 130, 1)),
        ("mm_f16_ktail", mm(H, 129, 33, 257, 3)),
        ("mm_f16_big_tile", mm(H, 2048, 40, 2048, 5)),
        (
            "mm_bf16_transposed",
            OpCase::new(Op::MatMul)
                .input_permuted(random(BF, &[200, 300], 7), &[1, 0])
                .input_permuted(random(BF, &[261, 200], 8), &[1, 0]),
        ),
        (
            "bmm_bf16",
            OpCase::new(Op::MatMul)
                .input(random(BF, &[4, 100, 64], 9))
                .input(random(BF, &[4, 64, 90], 10)),
        ),
        (
            "linear_bf16_bias",
            OpCase::new(Op::Linear)
                .input(random(BF, &[3, 100, 64], 11))
                .weight(random(BF, &[96, 64], 12))
                .weight(random(BF, &[96], 13)),
        ),
        (
            "addmm_f16",
            OpCase::new(Op::Addmm {
                beta: 0.5,
                alpha: 2.0,
            })
            .input(random(H, &[130], 14))
            .input(random(H, &[70, 90], 15))
            .input(random(H, &[90, 130], 16)),
        ),
        (
            "bmm_f16_split_k",
            OpCase::new(Op::MatMul)
                .input(random(H, &[2, 64, 4096], 17))
                .input(random(H, &[2, 4096, 64], 18)),
        ),
        (
            "conv_bf16",
            OpCase::new(conv)
                .input(random(BF, &[2, 16, 20, 20], 19))
                .weight(random(BF, &[64, 16, 3, 3], 20))
                .weight(random(BF, &[64], 21)),
        ),
        ("mm_f32_portable", mm(DType::F32, 256, 256, 256, 22)),
    ];
    list.into_iter()
        .map(|(name, case)| {
            let (graph, inputs) = case.build();
            Case {
                name,
                pte: compile_whole(&graph),
                inputs,
            }
        })
        .collect()
}

fn backend() -> Arc<MetalBackend> {
    Arc::new(MetalBackend::new(DeviceChoice::Auto))
}

/// Load `case` on `gpu` (building its pipelines) and run it once.
fn load_and_run(hyp: &str, gpu: &Arc<MetalBackend>, case: &Case, t: usize, round: usize) {
    eprintln!("begin {hyp} {} thread {t} round {round}", case.name);
    let _ = std::io::stderr().flush();
    let mut method = load_method_on(gpu.clone(), &case.pte);
    method
        .execute(case.inputs.clone())
        .unwrap_or_else(|e| panic!("{hyp} {}: execute: {e}", case.name));
}

/// Run `work(t)` on `threads` threads at once.
fn on_threads(threads: usize, work: impl Fn(usize) + Sync) {
    thread::scope(|s| {
        for t in 0..threads {
            let work = &work;
            s.spawn(move || work(t));
        }
    });
}

fn arg(args: &[String], flag: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{flag} {v}: not a count"))
        })
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let hyp = args.first().map(String::as_str).unwrap_or("list");
    let threads = arg(&args, "--threads", 8).max(1);
    let rounds = arg(&args, "--rounds", 5);
    let only = args
        .iter()
        .position(|a| a == "--case")
        .and_then(|i| args.get(i + 1));
    let (_, adapter) = select_adapter(DeviceChoice::Auto).unwrap_or_else(|e| panic!("{e}"));
    let info = adapter.get_info();
    eprintln!(
        "adapter {} ({:?}, driver {} {}), subgroups {}..{}",
        info.name,
        info.backend,
        info.driver,
        info.driver_info,
        info.subgroup_min_size,
        info.subgroup_max_size
    );
    let mut all = cases();
    if let Some(name) = only {
        all.retain(|c| c.name == name.as_str());
        assert!(!all.is_empty(), "--case {name}: no such case");
    }
    let all = &all;
    match hyp {
        "list" => {
            let coop = etmetal_metal_runtime::wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
            println!(
                "cooperative matrices: feature {}, configurations {:?}",
                adapter.features().contains(coop),
                adapter.cooperative_matrix_properties()
            );
            let gpu = backend();
            for c in all {
                let before = gpu.stats().alternatives_chosen;
                load_and_run(hyp, &gpu, c, 0, 0);
                let chosen = gpu.stats().alternatives_chosen - before;
                println!("{}: tensor-core dispatches chosen: {chosen}", c.name);
            }
        }
        "kernel" => {
            let gpu = backend();
            for c in all {
                for r in 0..rounds {
                    load_and_run(hyp, &gpu, c, 0, r);
                }
            }
        }
        "threads" => {
            let gpu = backend();
            on_threads(threads, |t| {
                for r in 0..rounds {
                    // each thread starts at a different case
                    for i in 0..all.len() {
                        load_and_run(hyp, &gpu, &all[(i + t) % all.len()], t, r);
                    }
                }
            });
        }
        "churn" => on_threads(threads, |t| {
            if t == 0 {
                let gpu = backend();
                for r in 0..rounds {
                    for c in all {
                        load_and_run(hyp, &gpu, c, t, r);
                    }
                }
            } else {
                // open an instance, an adapter and a device with
                // cooperative matrices, build nothing, drop them (as the
                // test binary's adapter checks and second backends do)
                for r in 0..rounds * all.len() {
                    eprintln!("begin churn device thread {t} round {r}");
                    let req = Requirements::default();
                    let d = GpuDevice::open_capped(DeviceChoice::Auto, Some(&req), None, true);
                    drop(d.unwrap_or_else(|e| panic!("churn: {e}")));
                }
            }
        }),
        other => {
            eprintln!("unknown hypothesis `{other}`: list, kernel, threads or churn");
            std::process::exit(2);
        }
    }
    println!("{hyp}: done ({threads} threads, {rounds} rounds)");
}
