//! The `etmetal` command line: `inspect` and `run` (see DESIGN.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use etmetal::Model;
use etmetal_core::{npy, Error, Result, Tensor};
use etmetal_graph::{InputKind, OutputKind};

#[derive(Parser)]
#[command(
    name = "etmetal",
    version,
    about = "Run and inspect programs exported with torch.export"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    Auto,
    Metal,
    Vulkan,
    Dx12,
    Cpu,
}

#[derive(Subcommand)]
enum Command {
    /// Show a program's inputs, outputs, weights and ops.
    Inspect {
        /// A `.pt2` archive written by `torch.export.save`.
        model: PathBuf,
    },
    /// Run a program and write its outputs as .npy files.
    ///
    /// NumPy has no bfloat16: bf16 outputs are written as float32, and a
    /// float32 .npy given for a bf16 (or float16) input is rounded to it.
    Run {
        /// A `.pt2` archive written by `torch.export.save`.
        model: PathBuf,
        /// Comma-separated .npy files, one per user input, in order.
        /// Without it every input is all ones of its declared shape.
        #[arg(long, value_delimiter = ',')]
        inputs: Vec<PathBuf>,
        /// Where to write output_0.npy, output_1.npy, ...
        #[arg(long, default_value = ".")]
        output_dir: PathBuf,
        /// Where to run. Only `cpu` exists in this build; `auto` means cpu.
        #[arg(long, value_enum, default_value = "auto", env = "ETMETAL_DEVICE")]
        device: Device,
        /// Execute N times after the warm-up runs and print latency figures.
        #[arg(long, value_name = "N")]
        bench: Option<usize>,
        /// Warm-up executions before timing (with --bench).
        #[arg(long, default_value_t = 1, value_name = "W")]
        warmup: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect { model } => inspect(&model),
        Command::Run {
            model,
            inputs,
            output_dir,
            device,
            bench,
            warmup,
        } => run(&model, &inputs, &output_dir, device, bench, warmup),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("etmetal: error: {e}");
            ExitCode::from(if e.is_user_error() { 2 } else { 1 })
        }
    }
}

fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn inspect(path: &Path) -> Result<()> {
    let model = Model::load(path)?;
    let graph = model.graph();
    println!("{}", path.display());
    println!("inputs:");
    for spec in model.inputs() {
        println!("  {}: {} {:?}", spec.name, spec.dtype, spec.shape);
    }
    println!("outputs:");
    for (v, kind) in &graph.outputs {
        let info = graph.value(*v);
        let what = match kind {
            OutputKind::User => String::new(),
            OutputKind::BufferMutation { fqn } => format!(" (new value of buffer {fqn})"),
            OutputKind::UserInputMutation { input_name } => {
                format!(" (mutates input {input_name})")
            }
        };
        println!("  {}: {} {:?}{what}", info.name, info.dtype, info.shape);
    }
    let mut weights = 0usize;
    let mut count = 0usize;
    for (v, kind) in &graph.inputs {
        if *kind != InputKind::User {
            count += 1;
            weights += graph.constants.get(v).map_or(0, Tensor::nbytes);
        }
    }
    println!(
        "parameters, buffers and constants: {count} tensors, {}",
        human_bytes(weights)
    );
    let mut histogram: BTreeMap<String, usize> = BTreeMap::new();
    for node in &graph.nodes {
        *histogram.entry(node.op.name()).or_default() += 1;
    }
    println!(
        "ops ({} nodes after decomposition, all supported on cpu):",
        graph.nodes.len()
    );
    for (name, n) in histogram {
        println!("  {n:>5}  {name}");
    }
    Ok(())
}

fn load_inputs(model: &Model, paths: &[PathBuf]) -> Result<Vec<Tensor>> {
    if paths.is_empty() {
        return model.ones_inputs();
    }
    paths.iter().map(|p| npy::read(p)).collect()
}

fn summary(t: &Tensor) -> String {
    let values = t.to_f64_vec();
    if values.is_empty() {
        return "empty".into();
    }
    let min = values.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = values.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let head: Vec<String> = values.iter().take(4).map(|v| format!("{v:.6}")).collect();
    format!(
        "min {min:.6} max {max:.6} mean {mean:.6} first [{}]",
        head.join(", ")
    )
}

fn run(
    path: &Path,
    input_paths: &[PathBuf],
    output_dir: &Path,
    device: Device,
    bench: Option<usize>,
    warmup: usize,
) -> Result<()> {
    if !matches!(device, Device::Cpu | Device::Auto) {
        return Err(Error::unsupported(format!(
            "device {device:?} is not available: this build runs on the cpu only (use --device cpu)"
        )));
    }
    let model = Model::load(path)?;
    let inputs = load_inputs(&model, input_paths)?;
    let start = Instant::now();
    let outputs = model.execute(inputs.clone())?;
    let elapsed = start.elapsed();
    std::fs::create_dir_all(output_dir).map_err(|e| Error::io(output_dir.display(), e))?;
    for (i, t) in outputs.iter().enumerate() {
        let file = output_dir.join(format!("output_{i}.npy"));
        npy::write(&file, t)?;
        println!(
            "output_{i}: {} {:?} {} -> {}",
            t.dtype(),
            t.shape(),
            summary(t),
            file.display()
        );
    }
    println!("ran on cpu in {:.3} ms", elapsed.as_secs_f64() * 1e3);
    if let Some(n) = bench {
        bench_model(&model, &inputs, n, warmup)?;
    }
    Ok(())
}

fn bench_model(model: &Model, inputs: &[Tensor], n: usize, warmup: usize) -> Result<()> {
    if n == 0 {
        return Err(Error::invalid_input("--bench needs at least one run"));
    }
    for _ in 0..warmup {
        model.execute(inputs.to_vec())?;
    }
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        model.execute(inputs.to_vec())?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let pick = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    println!(
        "bench: {n} runs after {warmup} warm-up: median {:.3} ms, p90 {:.3} ms",
        pick(0.5),
        pick(0.9)
    );
    Ok(())
}
