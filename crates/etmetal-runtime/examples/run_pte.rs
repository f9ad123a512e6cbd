//! Run a `.pte` on the CPU kernels, with the `etmetal run` command line:
//! `cargo run -p etmetal-runtime --example run_pte -- [run] MODEL.pte
//! [--inputs a.npy,b.npy] [--output-dir DIR] [--device cpu]`.
//! Without `--inputs` every input is all ones. Exit 2 on bad input, 1 on
//! internal failure.

use std::path::PathBuf;

use etmetal_core::{npy, Error, Result, Tensor};
use etmetal_runtime::Program;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(if e.is_user_error() { 2 } else { 1 });
    }
}

fn run(args: &[String]) -> Result<()> {
    let mut args = args.iter().map(String::as_str).peekable();
    args.next_if_eq(&"run");
    let usage = || {
        Error::invalid_input(
            "usage: run_pte [run] MODEL.pte [--inputs a.npy,...] [--output-dir DIR]",
        )
    };
    let model = args.next().ok_or_else(usage)?;
    let (mut inputs, mut out_dir) = (None, PathBuf::from("."));
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(usage)?;
        match flag {
            "--inputs" => inputs = Some(value),
            "--output-dir" => out_dir = PathBuf::from(value),
            "--device" if value == "cpu" => {}
            _ => return Err(usage()),
        }
    }
    let program = Program::load(model)?;
    let mut method = program.method("forward")?;
    let inputs = match inputs {
        Some(list) => list
            .split(',')
            .map(|p| npy::read(p.as_ref()))
            .collect::<Result<Vec<_>>>()?,
        None => method
            .input_specs()
            .iter()
            .map(|s| Tensor::from_f64(s.dtype, &s.shape, &vec![1.0; s.shape.iter().product()]))
            .collect::<Result<Vec<_>>>()?,
    };
    let outputs = method.execute(inputs)?;
    std::fs::create_dir_all(&out_dir).map_err(|e| Error::io(out_dir.display(), e))?;
    for (i, t) in outputs.iter().enumerate() {
        // numpy has no bf16: write it as float32 (exact).
        let t = if t.dtype() == etmetal_core::DType::BF16 {
            t.cast(etmetal_core::DType::F32)?
        } else {
            t.clone()
        };
        npy::write(&out_dir.join(format!("output_{i}.npy")), &t)?;
        println!("output {i}: {} {:?}", t.dtype(), t.shape());
    }
    Ok(())
}
