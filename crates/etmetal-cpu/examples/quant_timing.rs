//! By-hand timing of the CPU quantized linears (not a test):
//! `RAYON_NUM_THREADS=2 cargo run --profile ci -p etmetal-cpu --example quant_timing`
//! prints milliseconds per call, and GB/s of weight bytes (packed codes,
//! scales and zeros), for prefill- and decode-sized products: int4 group
//! 32, int8 group 32 and int8 per output channel.

use std::time::Instant;

use etmetal_core::quant::QuantFormat;
use etmetal_core::{DType, Tensor};

fn main() {
    for (m, k, n) in [
        (64, 640, 2048),
        (64, 2048, 8192),
        (1, 640, 2048),
        (1, 2048, 8192),
    ] {
        for format in [
            QuantFormat::int4(32),
            QuantFormat::int8(32),
            QuantFormat::int8(k),
        ] {
            let (per, gs) = (format.per_byte(), format.group_size);
            let packed =
                Tensor::from_slice(DType::U8, &[n, k / per], &vec![0x5au8; n * k / per]).unwrap();
            let side =
                Tensor::from_f32(DType::BF16, &[n, k / gs], &vec![0.01; n * k / gs]).unwrap();
            let bytes = packed.bytes().len() + 2 * side.bytes().len();
            let xs: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
            let dtype = DType::BF16;
            let x = Tensor::from_f32(dtype, &[m, k], &xs).unwrap();
            let call = || {
                etmetal_cpu::execute(
                    &format.linear_op(),
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
            let s = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "M={m} K={k} N={n} {} group {gs} {dtype}: {:.2} ms, {:.2} GB/s of weight bytes",
                format.name(),
                s * 1e3,
                bytes as f64 / s / 1e9
            );
        }
    }
}
