//! By-hand timing of the CPU int4 linear (not a test):
//! `RAYON_NUM_THREADS=2 cargo run --profile ci -p etmetal-cpu --example int4_timing`
//! prints milliseconds per call for prefill-sized products, group 32.

use std::time::Instant;

use etmetal_core::{DType, Op, Tensor};

fn main() {
    let gs = 32;
    for (m, k, n) in [
        (64, 640, 2048),
        (64, 2048, 8192),
        (1, 640, 2048),
        (1, 2048, 8192),
    ] {
        let packed = Tensor::from_slice(DType::U8, &[n, k / 2], &vec![0x5au8; n * k / 2]).unwrap();
        let side = Tensor::from_f32(DType::F32, &[n, k / gs], &vec![0.01; n * k / gs]).unwrap();
        let xs: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
        for dtype in [DType::F32, DType::BF16] {
            let x = Tensor::from_f32(dtype, &[m, k], &xs).unwrap();
            let call = || {
                etmetal_cpu::execute(
                    &Op::Int4Linear { group_size: gs },
                    &[Some(&x), Some(&packed), Some(&side), Some(&side)],
                    &[(dtype, vec![m, n])],
                )
                .unwrap()
            };
            call();
            let reps = 5;
            let t = Instant::now();
            for _ in 0..reps {
                call();
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
            println!("M={m} K={k} N={n} {dtype}: {ms:.1} ms");
        }
    }
}
