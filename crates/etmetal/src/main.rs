//! The `etmetal` command line: `compile`, `run` and `inspect` (DESIGN.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use etmetal::compile::{self, CompileOptions};
use etmetal::Model;
use etmetal_core::{npy, DType, Error, Result, Tensor};
use etmetal_graph::{InputKind, OutputKind};
use etmetal_metal::partitioner::{DeviceLimits, PartitionMode, PartitionOptions};
use etmetal_metal::payload::{gpu_bytes, Location, Payload};
use etmetal_metal_runtime::{select_adapter, DeviceChoice, MetalBackend};
use etmetal_pte::{DataLocation, EValue, Instruction, PteFile};

#[derive(Parser)]
#[command(
    name = "etmetal",
    version,
    about = "Compile, run and inspect programs exported with torch.export"
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

/// Whether GPU delegates may run the tensor-core (cooperative-matrix)
/// forms of their matrix products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Coop {
    /// Where the GPU offers what they need (16×16 f16 matrices, subgroups of 32).
    Auto,
    /// Never: every kernel runs its portable form.
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// GPU partitions through the EtMetalBackend delegate, the rest on CPU kernels.
    Metal,
    /// ExecuTorch portable-kernel calls only (runs in ExecuTorch's runtime too).
    Cpu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum FloatDtype {
    F32,
    Bf16,
    F16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Quantize {
    Int4,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Partition {
    /// Delegate what the GPU takes; the rest runs on CPU kernels between partitions.
    Auto,
    /// The whole graph must go to the GPU, else an error lists every node it does not take.
    Whole,
}

#[derive(Subcommand)]
enum Command {
    /// Compile a `.pt2` archive into an ExecuTorch `.pte` program.
    Compile {
        /// A `.pt2` archive written by `torch.export.save`: method `forward`.
        model: PathBuf,
        /// Another method of the same module, NAME=FILE.pt2 (`prefill=prefill.pt2`);
        /// repeatable. Buffers of the same name are one state in all methods.
        #[arg(long = "method", value_name = "NAME=FILE")]
        methods: Vec<String>,
        /// The `.pte` to write.
        #[arg(short, long)]
        output: PathBuf,
        /// What executes the program.
        #[arg(long, value_enum, default_value = "metal")]
        backend: Backend,
        /// How the Metal backend partitions the graph.
        #[arg(long, value_enum, default_value = "auto")]
        partition: Partition,
        /// Keep an op off the GPU, by its name in `inspect` (`sdpa`, `add`); repeatable.
        #[arg(long = "skip-op", value_name = "OP")]
        skip_ops: Vec<String>,
        /// Write each GPU kernel's `.wgsl` and its MSL translation (`.metal`) into DIR.
        #[arg(long, value_name = "DIR")]
        emit_msl: Option<PathBuf>,
        /// Compute in this float dtype: float32 inputs, weights and outputs
        /// become bf16 or f16 (as `module.to(dtype)` in PyTorch).
        #[arg(long, value_enum, default_value = "f32")]
        dtype: FloatDtype,
        /// Largest tensor the GPU takes (bytes, or with a K, M or G suffix):
        /// wgpu's storage-binding limit, 128M on every adapter; big GPUs
        /// offer more (the H200 about 4G). Larger tensors stay on the CPU;
        /// a file compiled above 128M needs a GPU that offers it.
        #[arg(long, value_name = "SIZE", default_value = "128M", value_parser = parse_size)]
        max_buffer: u64,
        /// Quantize the weights of every linear (`int4`: 4-bit weights, a
        /// scale and a zero per group of each output channel).
        #[arg(long, value_enum)]
        quantize: Option<Quantize>,
        /// Elements of K sharing one int4 scale and zero.
        #[arg(long, default_value = "32", value_parser = ["32", "64", "128", "256"])]
        group_size: String,
        /// Keep the linears whose weight or node name contains PATTERN in float; repeatable.
        #[arg(long = "quantize-skip", value_name = "PATTERN")]
        quantize_skip: Vec<String>,
    },
    /// Show a program: inputs, outputs, weights and ops (`.pt2`), or the
    /// execution plan, operators, delegates, segments and arenas (`.pte`).
    Inspect {
        /// A `.pt2` archive or a `.pte` program.
        model: PathBuf,
    },
    /// Run a program and write its outputs as .npy files.
    ///
    /// NumPy has no bfloat16: bf16 outputs are written as float32, and a
    /// float32 .npy given for a bf16 (or float16) input is rounded to it.
    Run {
        /// A `.pt2` archive or a `.pte` program.
        model: PathBuf,
        /// The method of a `.pte` to run.
        #[arg(long, default_value = "forward")]
        method: String,
        /// Comma-separated .npy files, one per user input, in order.
        /// Without it every input is all ones of its declared shape.
        #[arg(long, value_delimiter = ',')]
        inputs: Vec<PathBuf>,
        /// Where to write output_0.npy, output_1.npy, ...
        #[arg(long, default_value = ".")]
        output_dir: PathBuf,
        /// Where GPU work runs: `auto` picks Metal, then a discrete GPU, then
        /// any adapter, and falls back to the cpu (with a warning) when there
        /// is none. A `.pt2` is compiled in memory for the GPU first; `cpu`
        /// interprets it. What the GPU does not take runs on the cpu.
        #[arg(long, value_enum, default_value = "auto", env = "ETMETAL_DEVICE")]
        device: Device,
        /// Tensor-core forms of f16/bf16 matrix products (payload
        /// alternatives): `auto` runs them where the GPU offers them; off
        /// by default while they are experimental (README: Tensor cores).
        #[arg(long, value_enum, default_value = "off", env = "ETMETAL_COOP")]
        coop: Coop,
        /// Execute N times after the warm-up runs and print latency figures.
        #[arg(long, value_name = "N")]
        bench: Option<usize>,
        /// Warm-up executions before timing (with --bench).
        #[arg(long, default_value_t = 1, value_name = "W")]
        warmup: usize,
        /// Also write the --bench figures (latencies, per-kernel GPU times,
        /// peak memory) to FILE as JSON.
        #[arg(long, value_name = "FILE", requires = "bench")]
        bench_json: Option<PathBuf>,
    },
}

/// Append one line to the command's output, which `main` prints at the end.
macro_rules! say {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

fn main() -> ExitCode {
    // Mesa's Vulkan drivers print a line on stderr when XDG_RUNTIME_DIR is
    // unset (a headless server); our errors are one line, so give them one.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    let cli = Cli::parse();
    let mut out = String::new();
    let result = match cli.command {
        Command::Compile {
            model,
            methods,
            output,
            backend,
            partition,
            skip_ops,
            emit_msl,
            dtype,
            max_buffer,
            quantize,
            group_size,
            quantize_skip,
        } => {
            let options = CompileOptions {
                backend: match backend {
                    Backend::Metal => compile::Backend::Metal,
                    Backend::Cpu => compile::Backend::Cpu,
                },
                partition: PartitionOptions {
                    mode: match partition {
                        Partition::Auto => PartitionMode::Auto,
                        Partition::Whole => PartitionMode::Whole,
                    },
                    skip_ops,
                    limits: DeviceLimits {
                        max_buffer_bytes: max_buffer,
                        ..DeviceLimits::default()
                    },
                },
                ..CompileOptions::default()
            };
            let dtype = match dtype {
                FloatDtype::F32 => DType::F32,
                FloatDtype::Bf16 => DType::BF16,
                FloatDtype::F16 => DType::F16,
            };
            let int4 = quantize.map(|Quantize::Int4| Int4Options {
                group_size: group_size.parse().unwrap_or(32),
                skip: quantize_skip,
            });
            compile_cmd(
                &mut out,
                &model,
                &methods,
                &output,
                &options,
                dtype,
                int4.as_ref(),
                emit_msl.as_deref(),
            )
        }
        Command::Inspect { model } => inspect(&mut out, &model),
        Command::Run {
            model,
            method,
            inputs,
            output_dir,
            device,
            coop,
            bench,
            warmup,
            bench_json,
        } => run(
            &mut out,
            &model,
            &method,
            &inputs,
            &output_dir,
            (device, coop),
            bench.map(|runs| Bench {
                runs,
                warmup,
                json: bench_json,
            }),
        ),
    };
    // A closed pipe (`etmetal inspect m.pte | head`) is not an error.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes());
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

/// `--quantize int4` and its options.
struct Int4Options {
    group_size: usize,
    skip: Vec<String>,
}

#[allow(clippy::too_many_arguments)]
fn compile_cmd(
    out: &mut String,
    path: &Path,
    extra: &[String],
    output: &Path,
    options: &CompileOptions,
    dtype: DType,
    int4: Option<&Int4Options>,
    emit_msl: Option<&Path>,
) -> Result<()> {
    let start = Instant::now();
    let mut files = vec![("forward".to_string(), path.to_path_buf())];
    for m in extra {
        let (name, file) = m
            .split_once('=')
            .ok_or_else(|| Error::invalid_input(format!("--method {m}: expected NAME=FILE.pt2")))?;
        files.push((name.to_string(), PathBuf::from(file)));
    }
    let mut graphs = Vec::with_capacity(files.len());
    for (name, file) in &files {
        let mut graph = etmetal_graph::load_pt2(file)?;
        etmetal_graph::precision::convert_floats(&mut graph, dtype)
            .map_err(|e| e.context(format!("method `{name}` ({})", file.display())))?;
        if let Some(q) = int4 {
            let r = etmetal_graph::quantize::quantize_int4(&mut graph, q.group_size, &q.skip)?;
            eprintln!(
                "etmetal: method `{name}`: {} linears in int4 (group {}), {} kept in float",
                r.quantized.len(),
                q.group_size,
                r.skipped.len()
            );
            for (node, why) in &r.skipped {
                eprintln!("etmetal:   {node} stays in float: {why}");
            }
        }
        graphs.push(graph);
    }
    let methods: Vec<(&str, &etmetal_graph::Graph)> = files
        .iter()
        .zip(&graphs)
        .map(|((name, _), g)| (name.as_str(), g))
        .collect();
    // progress goes to stderr as it happens; the summary to stdout
    let compiled =
        compile::compile_methods(&methods, options, &mut |line| eprintln!("etmetal: {line}"))
            .map_err(|e| e.context(format!("compiling {}", path.display())))?;
    std::fs::write(output, &compiled.pte).map_err(|e| Error::io(output.display(), e))?;
    say!(
        out,
        "wrote {} ({}) in {:.0} ms",
        output.display(),
        human_bytes(compiled.pte.len()),
        start.elapsed().as_secs_f64() * 1e3
    );
    for m in compiled
        .methods
        .iter()
        .filter(|_| options.backend == compile::Backend::Metal)
    {
        let kernels: usize = m.partitions.iter().map(|p| p.payload.kernels.len()).sum();
        let delegated: usize = m.partitions.iter().map(|p| p.nodes.len()).sum();
        // a one-method program keeps the summary it always had
        let method = match compiled.methods.len() {
            1 => String::new(),
            _ => format!("method `{}`: ", m.name),
        };
        say!(
            out,
            "{method}EtMetalBackend: {} partition(s), {delegated} node(s), {kernels} kernel(s); {} node(s) on the cpu",
            m.partitions.len(),
            m.cpu_nodes.len()
        );
        if !m.resident_state.is_empty() {
            say!(
                out,
                "  state kept on the GPU: {}",
                m.resident_state.join(", ")
            );
        }
        for (node, op, reason) in &m.cpu_nodes {
            say!(out, "  cpu: `{node}` ({op}): {reason}");
        }
    }
    if let Some(dir) = emit_msl {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display(), e))?;
        let mut files = 0;
        let one = compiled.methods.len() == 1;
        for m in &compiled.methods {
            // with several methods, each file name starts with its method's
            let prefix = if one {
                String::new()
            } else {
                format!("{}_", m.name)
            };
            for p in &m.partitions {
                for k in &p.payload.kernels {
                    for (ext, text) in [("wgsl", &k.wgsl), ("metal", &k.msl)] {
                        let file = dir.join(format!("{prefix}{}_{}.{ext}", p.tag, k.name));
                        std::fs::write(&file, text).map_err(|e| Error::io(file.display(), e))?;
                        files += 1;
                    }
                }
            }
        }
        say!(out, "wrote {files} kernel sources to {}", dir.display());
    }
    Ok(())
}

/// Inspecting a `.pte` reads the file only: a program whose delegates this
/// build cannot run can still be looked at.
fn inspect(out: &mut String, path: &Path) -> Result<()> {
    say!(out, "{}", path.display());
    if etmetal::is_pte(path)? {
        inspect_pte(out, &PteFile::load(path)?)
    } else {
        inspect_graph(
            out,
            Model::load(path)?
                .graph()
                .ok_or_else(|| Error::internal("a .pt2 model has a graph"))?,
        )
    }
}

fn inspect_graph(out: &mut String, graph: &etmetal_graph::Graph) -> Result<()> {
    say!(out, "inputs:");
    for v in graph.user_inputs() {
        let info = graph.value(v);
        say!(out, "  {}: {} {:?}", info.name, info.dtype, info.shape);
    }
    say!(out, "outputs:");
    for (v, kind) in &graph.outputs {
        let info = graph.value(*v);
        let what = match kind {
            OutputKind::User => String::new(),
            OutputKind::BufferMutation { fqn } => format!(" (new value of buffer {fqn})"),
            OutputKind::UserInputMutation { input_name } => {
                format!(" (mutates input {input_name})")
            }
        };
        say!(
            out,
            "  {}: {} {:?}{what}",
            info.name,
            info.dtype,
            info.shape
        );
    }
    let mut weights = 0usize;
    let mut count = 0usize;
    for (v, kind) in &graph.inputs {
        if *kind != InputKind::User {
            count += 1;
            weights += graph.constants.get(v).map_or(0, Tensor::nbytes);
        }
    }
    say!(
        out,
        "parameters, buffers and constants: {count} tensors, {}",
        human_bytes(weights)
    );
    let mut histogram: BTreeMap<String, usize> = BTreeMap::new();
    for node in &graph.nodes {
        *histogram.entry(node.op.name()).or_default() += 1;
    }
    say!(
        out,
        "ops ({} nodes after decomposition, all supported on cpu):",
        graph.nodes.len()
    );
    for (name, n) in histogram {
        say!(out, "  {n:>5}  {name}");
    }
    Ok(())
}

/// An EtMetalBackend payload: its kernels with the ops fused into each,
/// their dispatches and the memory they use.
fn inspect_payload(out: &mut String, payload: &Payload) {
    let arena: u64 = payload.arenas.iter().sum();
    let weights: u64 = payload
        .buffers
        .iter()
        .filter(|b| matches!(b.location, Location::Weight { .. }))
        .map(|b| gpu_bytes(b.dtype, b.shape.iter().product()).unwrap_or(0))
        .sum();
    say!(
        out,
        "    {} kernels, {} dispatches, arena {}, weights {}",
        payload.kernels.len(),
        payload.dispatches.len(),
        human_bytes(arena as usize),
        human_bytes(weights as usize)
    );
    if !payload.state.is_empty() {
        let state: Vec<String> = payload
            .state
            .iter()
            .map(|s| format!("{} (input {})", s.fqn, s.input))
            .collect();
        say!(out, "    state kept on the GPU: {}", state.join(", "));
    }
    let dispatch = |out: &mut String, d: &etmetal_metal::payload::Dispatch, indent: &str| {
        let k = &payload.kernels[d.kernel];
        let [x, y, z] = d.workgroups;
        let [wx, wy, wz] = k.workgroup_size;
        say!(
            out,
            "{indent}{}  [{}]  workgroups {x}x{y}x{z} of {wx}x{wy}x{wz}",
            k.name,
            k.ops.join(", ")
        );
    };
    for d in &payload.dispatches {
        dispatch(out, d, "      ");
        for a in &d.alternatives {
            say!(
                out,
                "        or, where the GPU has cooperative matrices {} and {} bytes of \
                 workgroup memory:",
                a.needs.describe(),
                a.needs.workgroup_storage
            );
            for inner in &a.dispatches {
                dispatch(out, inner, "          ");
            }
        }
    }
}

fn inspect_pte(out: &mut String, file: &PteFile) -> Result<()> {
    let program = &file.program;
    say!(out, "segments:");
    for (i, seg) in program.segments.iter().enumerate() {
        say!(
            out,
            "  {i}: offset {} size {}",
            seg.offset,
            human_bytes(seg.size as usize)
        );
    }
    if let Some(constants) = &program.constant_segment {
        say!(
            out,
            "constants: {} buffers in segment {}",
            constants.offsets.len().saturating_sub(1),
            constants.segment_index
        );
    }
    for nd in &program.named_data {
        say!(
            out,
            "named data `{}` -> segment {}",
            nd.key,
            nd.segment_index
        );
    }
    for (p, plan) in program.execution_plan.iter().enumerate() {
        say!(out, "method `{}`:", plan.name);
        let tensor = |v: &i32| match plan.values.get(*v as usize) {
            Some(EValue::Tensor(t)) => format!("{v}: {} {:?}", t.scalar_type, t.sizes),
            Some(other) => format!("{v}: {other:?}"),
            None => format!("{v}: (out of range)"),
        };
        say!(
            out,
            "  inputs:  {}",
            plan.inputs
                .iter()
                .map(tensor)
                .collect::<Vec<_>>()
                .join(", ")
        );
        say!(
            out,
            "  outputs: {}",
            plan.outputs
                .iter()
                .map(tensor)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let arenas: Vec<String> = plan
            .non_const_buffer_sizes
            .iter()
            .skip(1)
            .map(|&n| human_bytes(n as usize))
            .collect();
        say!(
            out,
            "  values: {}, planned arenas: [{}]",
            plan.values.len(),
            arenas.join(", ")
        );
        say!(out, "  operators:");
        for (i, op) in plan.operators.iter().enumerate() {
            say!(out, "    {i}: {}", op.qualified_name());
        }
        for (i, d) in plan.delegates.iter().enumerate() {
            let index = d.processed.index as usize;
            let size = match d.processed.location {
                DataLocation::Segment => program.segments.get(index).map_or(0, |s| s.size as usize),
                DataLocation::Inline => program
                    .backend_delegate_data
                    .get(index)
                    .map_or(0, |b| b.data.len()),
            };
            let specs: Vec<&str> = d.compile_specs.iter().map(|c| c.key.as_str()).collect();
            say!(
                out,
                "  delegate {i}: {} ({}), compile specs [{}]",
                d.id,
                human_bytes(size),
                specs.join(", ")
            );
            if d.id == etmetal_metal::BACKEND_ID {
                inspect_payload(out, &Payload::decode(file.delegate_data(p, i)?)?);
            }
        }
        for (c, chain) in plan.chains.iter().enumerate() {
            say!(
                out,
                "  chain {c}: {} instructions",
                chain.instructions.len()
            );
            for (i, ins) in chain.instructions.iter().enumerate() {
                say!(out, "    {i:>4}  {}", describe(plan, ins));
            }
        }
    }
    Ok(())
}

fn describe(plan: &etmetal_pte::ExecutionPlan, ins: &Instruction) -> String {
    match ins {
        Instruction::KernelCall(k) => {
            let op = plan
                .operators
                .get(k.op_index as usize)
                .map(|o| o.qualified_name());
            format!("{} {:?}", op.unwrap_or_else(|| "?".into()), k.args)
        }
        Instruction::DelegateCall(d) => format!("delegate {} {:?}", d.delegate_index, d.args),
        Instruction::MoveCall(m) => format!("move {} -> {}", m.move_from, m.move_to),
        Instruction::JumpFalseCall(j) => {
            format!(
                "jump to {} if value {} is false",
                j.destination_instruction, j.cond_value_index
            )
        }
        Instruction::FreeCall(f) => format!("free {}", f.value_index),
    }
}

fn load_inputs(model: &Model, method: &str, paths: &[PathBuf]) -> Result<Vec<Tensor>> {
    if paths.is_empty() {
        return model
            .method_inputs(method)?
            .iter()
            .map(etmetal_core::TensorSpec::ones)
            .collect();
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

#[allow(clippy::too_many_arguments)]
fn run(
    out: &mut String,
    path: &Path,
    method: &str,
    input_paths: &[PathBuf],
    output_dir: &Path,
    (device, coop): (Device, Coop),
    bench: Option<Bench>,
) -> Result<()> {
    // a .pte is loaded once: its delegates decide the backend it runs with
    let pte = match etmetal::is_pte(path)? {
        true => Some(etmetal_runtime::Program::load(path)?),
        false => None,
    };
    let delegated = pte.as_ref().map_or(0, |p| gpu_delegates(p.file()));
    let gpu = gpu_backend(path, pte.is_some(), delegated, device, coop)?;
    let mut options = etmetal_runtime::LoadOptions::default();
    if let Some(backend) = &gpu {
        options.backends.register(backend.clone())?;
    }
    let mut model = match (pte, &gpu) {
        (Some(program), _) => Model::from_pte_program(program, options)
            .map_err(|e| e.context(path.display().to_string()))?,
        // a .pt2 on a GPU: compiled in memory with the Metal backend first
        (None, Some(backend)) => {
            let graph = etmetal_graph::load_pt2(path)?;
            let for_adapter = CompileOptions {
                partition: PartitionOptions {
                    limits: DeviceLimits {
                        max_buffer_bytes: backend.max_binding_bytes()?,
                        ..DeviceLimits::default()
                    },
                    ..PartitionOptions::default()
                },
                ..CompileOptions::default()
            };
            let compiled = compile::compile(&graph, &for_adapter, &mut |_| {})
                .map_err(|e| e.context(format!("compiling {}", path.display())))?;
            Model::from_pte_bytes(&compiled.pte, options)?
        }
        (None, None) => Model::load_with(path, options)?,
    };
    let load_peak = bench.as_ref().and_then(|_| peak_rss());
    let adapter = gpu
        .as_ref()
        .and_then(|b| b.device())
        .map(|d| d.description());
    let inputs = load_inputs(&model, method, input_paths)?;
    let start = Instant::now();
    let outputs = model.execute_method(method, inputs.clone())?;
    let elapsed = start.elapsed();
    std::fs::create_dir_all(output_dir).map_err(|e| Error::io(output_dir.display(), e))?;
    for (i, t) in outputs.iter().enumerate() {
        let file = output_dir.join(format!("output_{i}.npy"));
        npy::write(&file, t)?;
        say!(
            out,
            "output_{i}: {} {:?} {} -> {}",
            t.dtype(),
            t.shape(),
            summary(t),
            file.display()
        );
    }
    let place = match &adapter {
        Some(adapter) => format!("gpu {adapter} and cpu"),
        None => "cpu".to_string(),
    };
    say!(
        out,
        "ran on {place} in {:.3} ms",
        elapsed.as_secs_f64() * 1e3
    );
    if let Some(bench) = bench {
        let report = bench_model(out, &mut model, method, &inputs, &bench, gpu.as_deref())?;
        if let Some(file) = &bench.json {
            let mut json = report;
            json["model"] = path.display().to_string().into();
            json["device"] = place.into();
            json["peak_rss_after_load_bytes"] = load_peak.into();
            json["peak_rss_bytes"] = peak_rss().into();
            let text = serde_json::to_string_pretty(&json)
                .map_err(|e| Error::internal(format!("writing the bench JSON: {e}")))?;
            std::fs::write(file, text + "\n").map_err(|e| Error::io(file.display(), e))?;
        }
    }
    Ok(())
}

/// How many `EtMetalBackend` delegates `file` holds.
fn gpu_delegates(file: &PteFile) -> usize {
    file.program
        .execution_plan
        .iter()
        .flat_map(|p| &p.delegates)
        .filter(|d| d.id == etmetal_metal_runtime::BACKEND_ID)
        .count()
}

/// The GPU backend a run uses, after checking `device` finds an adapter;
/// `None` runs on the CPU kernels: a `.pte` with no GPU delegates, a `.pt2`
/// with `--device cpu` or, with `auto`, no adapter (one warning line). A
/// `.pt2` with a GPU is compiled in memory for it.
fn gpu_backend(
    path: &Path,
    pte: bool,
    delegated: usize,
    device: Device,
    coop: Coop,
) -> Result<Option<Arc<MetalBackend>>> {
    let choice = match device {
        Device::Cpu => return cpu_only(path, pte, delegated, "--device cpu was given"),
        Device::Auto => DeviceChoice::Auto,
        Device::Metal => DeviceChoice::Metal,
        Device::Vulkan => DeviceChoice::Vulkan,
        Device::Dx12 => DeviceChoice::Dx12,
    };
    if pte && delegated == 0 {
        if device != Device::Auto {
            eprintln!(
                "etmetal: warning: {} has no GPU delegates and runs on the cpu (--device {} is not used)",
                path.display(),
                choice.name()
            );
        }
        return Ok(None);
    }
    match select_adapter(choice) {
        Ok(_) => Ok(Some(Arc::new(
            MetalBackend::new(choice).with_cooperative_matrix(coop == Coop::Auto),
        ))),
        Err(e) if device == Device::Auto => cpu_only(path, pte, delegated, e.message()),
        Err(e) => Err(e),
    }
}

/// No GPU for this run: fine for a `.pt2` (interpreted on the CPU, with a
/// warning), an error for a `.pte` whose delegates need one.
fn cpu_only(
    path: &Path,
    pte: bool,
    delegated: usize,
    why: &str,
) -> Result<Option<Arc<MetalBackend>>> {
    if !pte {
        if !why.starts_with("--device cpu") {
            eprintln!("etmetal: warning: no GPU ({why}); running on the cpu");
        }
        return Ok(None);
    }
    if delegated == 0 {
        return Ok(None);
    }
    Err(Error::unsupported(format!(
        "{} delegates {delegated} partition(s) to {}, which needs a GPU ({why}); \
         compile with --backend cpu to run on the CPU",
        path.display(),
        etmetal_metal_runtime::BACKEND_ID
    )))
}

/// `--max-buffer`'s value: bytes, or K/M/G (binary multiples) of them.
fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let (digits, shift) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 10),
        Some((i, 'M' | 'm')) => (&text[..i], 20),
        Some((i, 'G' | 'g')) => (&text[..i], 30),
        _ => (text, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{text}` is not a size such as 134217728, 128M or 4G"))
}

/// `run --bench`: how many timed and warm-up executes, where to write JSON.
struct Bench {
    runs: usize,
    warmup: usize,
    json: Option<PathBuf>,
}

/// The `q` quantile (nearest rank) of sorted `v`.
fn quantile(v: &[f64], q: f64) -> f64 {
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The process's peak resident set so far, in bytes (Linux `VmHWM`; `None`
/// where /proc is absent).
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    kib.trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

/// Time `bench.runs` executes after `bench.warmup`; then, where the GPU has
/// timestamp queries, as many profiled executes for per-kernel GPU times
/// (apart, since a profiled execute gives each dispatch its own pass).
/// Prints the figures and returns them as JSON.
fn bench_model(
    out: &mut String,
    model: &mut Model,
    method: &str,
    inputs: &[Tensor],
    bench: &Bench,
    gpu: Option<&MetalBackend>,
) -> Result<serde_json::Value> {
    let (n, warmup) = (bench.runs, bench.warmup);
    if n == 0 {
        return Err(Error::invalid_input("--bench needs at least one run"));
    }
    for _ in 0..warmup {
        model.execute_method(method, inputs.to_vec())?;
    }
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        model.execute_method(method, inputs.to_vec())?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let (median, p90) = (quantile(&sorted, 0.5), quantile(&sorted, 0.9));
    say!(
        out,
        "bench: {n} runs after {warmup} warm-up: median {median:.3} ms, p90 {p90:.3} ms"
    );
    let gpu_json = match gpu {
        Some(g) if g.can_profile() => gpu_profile(out, model, method, inputs, n, g)?,
        Some(_) => {
            let why = "the GPU adapter has no timestamp queries";
            say!(out, "bench: no per-kernel GPU times: {why}");
            serde_json::json!({ "unavailable": why })
        }
        None => serde_json::Value::Null,
    };
    Ok(serde_json::json!({
        "runs": n,
        "warmup": warmup,
        "latency_ms": {
            "median": median,
            "p90": p90,
            "min": sorted[0],
            "mean": times.iter().sum::<f64>() / n as f64,
        },
        "times_ms": times,
        "gpu": gpu_json,
    }))
}

/// `n` profiled executes: per dispatch (in execution order) its median GPU
/// time, printed one line each with its share of the median GPU total.
fn gpu_profile(
    out: &mut String,
    model: &mut Model,
    method: &str,
    inputs: &[Tensor],
    n: usize,
    gpu: &MetalBackend,
) -> Result<serde_json::Value> {
    gpu.take_dispatch_times();
    gpu.set_profiling(true);
    let mut runs = Vec::with_capacity(n);
    let mut result = Ok(());
    for _ in 0..n {
        result = model.execute_method(method, inputs.to_vec()).map(drop);
        if result.is_err() {
            break;
        }
        runs.push(gpu.take_dispatch_times());
    }
    gpu.set_profiling(false);
    result?;
    let per_run = runs[0].len();
    if let Some(r) = runs.iter().find(|r| r.len() != per_run) {
        return Err(Error::internal(format!(
            "profiled executes ran {per_run} and {} dispatches",
            r.len()
        )));
    }
    let median_of = |f: &dyn Fn(&[etmetal_metal_runtime::DispatchTime]) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(|r| f(r) * 1e3).collect();
        v.sort_by(f64::total_cmp);
        quantile(&v, 0.5)
    };
    let total = median_of(&|r| r.iter().map(|t| t.seconds).sum());
    say!(
        out,
        "bench: GPU time {total:.3} ms median over {n} profiled runs, {per_run} dispatches:"
    );
    let mut kernels = Vec::with_capacity(per_run);
    for (d, first) in runs[0].iter().enumerate() {
        let ms = median_of(&|r| r[d].seconds);
        let share = if total > 0.0 { ms / total } else { 0.0 };
        let variant = first
            .variant
            .as_ref()
            .map_or(String::new(), |v| format!("  (alternative: {v})"));
        say!(
            out,
            "  {:<40} {:>10.4} ms {:>5.1}%  [{}]{variant}",
            first.kernel,
            ms,
            share * 100.0,
            first.ops.join(", ")
        );
        kernels.push(serde_json::json!({
            "kernel": first.kernel,
            "variant": first.variant,
            "ops": first.ops,
            "median_ms": ms,
            "share": share,
        }));
    }
    Ok(serde_json::json!({
        "profiled_runs": n,
        "total_ms_median": total,
        "dispatches": kernels,
    }))
}
