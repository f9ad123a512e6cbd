//! The `etmetal` command line: `compile`, `run`, `generate`, `transcribe`,
//! `chat` and `inspect` (README: Command line). This file holds the
//! arguments and what each command does with them; `inspect` and `run
//! --bench` have modules of their own, and the work of `generate`,
//! `transcribe` and `chat` is the library's (`etmetal::generate`,
//! `etmetal::transcribe`, `etmetal::chat`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use etmetal::compile::{self, CompileOptions};
use etmetal::device::{self, DevicePreference, TensorCores, Workload};
use etmetal::Model;
use etmetal_core::{npy, DType, Error, Result, Tensor};
use etmetal_graph::quantize::{QuantizeOptions, Scheme};
use etmetal_metal::partitioner::{DeviceLimits, PartitionMode, PartitionOptions};
use etmetal_metal_runtime::MetalBackend;

/// Append one line to the command's output, which `main` prints at the end.
macro_rules! say {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

mod cli {
    pub mod bench;
    pub mod inspect;
}

use cli::bench::{bench_model, peak_rss, Bench};

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

impl Device {
    fn preference(self) -> DevicePreference {
        match self {
            Device::Auto => DevicePreference::Auto,
            Device::Metal => DevicePreference::Metal,
            Device::Vulkan => DevicePreference::Vulkan,
            Device::Dx12 => DevicePreference::Dx12,
            Device::Cpu => DevicePreference::Cpu,
        }
    }
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
    /// 4-bit codes, a scale and a zero per group of 32 (--group-size).
    Int4,
    /// 8-bit codes, a scale and a zero per output channel (or per group
    /// with --group-size, a multiple of 32).
    Int8,
    /// int8 for the weights whose int4 form changes their output most
    /// (measured; with --calibrate on its activations), int4 for the rest.
    Mixed,
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
        /// A `.pt2` archive written by `torch.export.save`: method `forward`
        /// (optional where `--method` gives every method).
        #[arg(required_unless_present = "methods")]
        model: Option<PathBuf>,
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
        /// Quantize the weights of every linear (weight-only: a scale and
        /// a zero per group of each output channel).
        #[arg(long, value_enum)]
        quantize: Option<Quantize>,
        /// Elements of K sharing one scale and zero: int4 (and mixed's
        /// int4) 32, 64, 128 or 256 (default 32); int8 a multiple of 32
        /// (default: all of K, one per output channel).
        #[arg(long, value_name = "G", requires = "quantize")]
        group_size: Option<usize>,
        /// Keep the linears (and MoE expert weights) whose weight or node name contains PATTERN in float; repeatable.
        #[arg(long = "quantize-skip", value_name = "PATTERN")]
        quantize_skip: Vec<String>,
        /// Calibrate the quantization on FILE (GPTQ error feedback over the
        /// activations the model computes on it, run here on the CPU): UTF-8
        /// text with --tokenizer, else token ids (integers separated by
        /// spaces or commas); at least 256 tokens.
        #[arg(long, value_name = "FILE", requires = "quantize")]
        calibrate: Option<PathBuf>,
        /// The tokenizer.json that turns the --calibrate text into tokens.
        #[arg(long, value_name = "FILE", requires = "calibrate")]
        tokenizer: Option<PathBuf>,
    },
    /// Show a program: inputs, outputs, weights and ops (`.pt2`), or a
    /// summary of each method of a `.pte` (inputs, outputs, what the GPU
    /// takes, what stays on the CPU, weight and arena bytes).
    Inspect {
        /// A `.pt2` archive or a `.pte` program.
        model: PathBuf,
        /// After a `.pte`'s summary, list everything: segments, named data,
        /// values, operators, each delegate's kernels, every instruction.
        #[arg(short, long)]
        verbose: bool,
    },
    /// Generate text with a decoder `.pte`, streaming it to stdout; prefill
    /// and decode tokens/s go to stderr.
    Generate(GenerateArgs),
    /// Transcribe a WAV file with a speech program (Whisper from
    /// scripts/export_whisper.py, or a CTC model), streaming the text to
    /// stdout; the real-time factor goes to stderr.
    Transcribe(TranscribeArgs),
    /// Chat with a decoder `.pte` in its chat template, the KV cache kept
    /// across turns; prompts from the terminal, a file or stdin.
    Chat(ChatArgs),
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
        #[command(flatten)]
        device: DeviceArgs,
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
        /// Print where one execute's host time goes (each CPU kernel call;
        /// in a GPU delegate its uploads, submit, wait and read-backs) to
        /// stderr: the first execute, and with --bench one more after the
        /// timed ones. `ETMETAL_TRACE=1` traces every execute.
        #[arg(long)]
        trace: bool,
    },
}

/// `etmetal generate`'s options (crates/etmetal/src/generate.rs does the work).
#[derive(clap::Args)]
struct GenerateArgs {
    /// A decoder `.pte`: `forward(tokens int64 [1, 1], positions int64 [1])`
    /// returns logits and keeps the KV cache in mutable buffers (transformers'
    /// ExecuTorch recipe); an optional `prefill` method takes [1, P] tokens.
    model: PathBuf,
    /// The tokenizer.json transformers saves (`tokenizer.save_pretrained`);
    /// end-of-sequence ids come from generation_config.json beside it.
    #[arg(long, required_unless_present = "replay")]
    tokenizer: Option<PathBuf>,
    /// The text to continue.
    #[arg(long, required_unless_present = "replay")]
    prompt: Option<String>,
    /// New tokens at most.
    #[arg(long, default_value_t = 128, value_name = "N")]
    max_tokens: usize,
    /// 0: greedy; above 0, sample softmax(logits / T).
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    temperature: f32,
    /// Sample only from the most likely tokens whose probabilities add up to P.
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    top_p: f32,
    /// Seed for sampling (default: from the clock).
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// A token that ends generation, by id or text (`<end_of_turn>`);
    /// repeatable; replaces the configured ones.
    #[arg(long = "eos", value_name = "TOKEN")]
    eos: Vec<String>,
    #[command(flatten)]
    device: DeviceArgs,
    /// Instead of generating, run any stateful program step by step on
    /// DIR/step{k}_input{i}.npy (method from DIR/step{k}_method.txt) and
    /// write DIR/step{k}_output{i}.npy, through one loaded model (on a GPU,
    /// also DIR/step{k}_transfers.txt: the bytes the step uploaded and read
    /// back).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["tokenizer", "prompt"])]
    replay: Option<PathBuf>,
    /// Steps to replay.
    #[arg(long, default_value_t = 1, requires = "replay")]
    steps: usize,
    /// Replay R times, resetting the state between (run r > 0 writes run{r}_step…).
    #[arg(long, default_value_t = 1, requires = "replay")]
    repeat: usize,
}

/// Where GPU work runs, shared by the commands that run a program.
#[derive(clap::Args)]
struct DeviceArgs {
    /// Where GPU work runs: `auto` picks Metal, then a discrete GPU, then
    /// any adapter, and falls back to the cpu (with a warning) when there
    /// is none. A `.pt2` is compiled in memory for the GPU first; `cpu`
    /// interprets it. What the GPU does not take runs on the cpu.
    #[arg(long, value_enum, default_value = "auto", env = "ETMETAL_DEVICE")]
    device: Device,
    /// Tensor-core forms of f16/bf16 matrix products (payload
    /// alternatives): `auto`, the default, measures those that have run on
    /// a real GPU against the portable kernels the first time a program
    /// loads on a GPU offering them, and keeps a form only where it is
    /// faster (cached on disk); `all` adds the forms never run yet; `off`
    /// runs the portable kernels only (README: Tensor cores).
    #[arg(long, value_enum, default_value_t, env = "ETMETAL_COOP")]
    coop: TensorCores,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TaskArg {
    Transcribe,
    Translate,
}

/// `etmetal transcribe`'s options (crates/etmetal/src/transcribe/ does the work).
#[derive(clap::Args)]
struct TranscribeArgs {
    /// A speech `.pte`: Whisper (methods `encoder` and `text_decoder`, from
    /// scripts/export_whisper.py) or a CTC model (`forward(input_values
    /// [1, samples]) -> logits`).
    model: PathBuf,
    /// A WAV file: any sample rate (resampled to 16 kHz) and channel count
    /// (averaged); 8/16/24/32-bit integer or 32-bit float samples.
    audio: PathBuf,
    /// Whisper's language (`en`, `english`); detected from the first
    /// window when not given (multilingual models).
    #[arg(long, value_name = "L")]
    language: Option<String>,
    /// Whisper's task: `translate` writes English text.
    #[arg(long, value_enum, default_value = "transcribe")]
    task: TaskArg,
    /// Whisper's timestamps: one `[start --> end] text` line per segment.
    #[arg(long)]
    timestamps: bool,
    /// The folder with the model's tokenizer.json, generation_config.json
    /// (Whisper) or vocab.json (CTC); default: the program's folder.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// Print each window's token ids (Whisper: the decoder's sequence, as
    /// transformers' generate() returns it; CTC: each frame's) instead of text.
    #[arg(long)]
    ids: bool,
    /// Write each window's model input (log-mel features, or CTC samples)
    /// as DIR/window{k}.npy.
    #[arg(long, value_name = "DIR")]
    dump_features: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
}

/// `etmetal chat`'s options (crates/etmetal/src/chat.rs does the work).
#[derive(clap::Args)]
struct ChatArgs {
    /// A decoder `.pte`, as for `generate`.
    model: PathBuf,
    /// The tokenizer folder (tokenizer.json, tokenizer_config.json or
    /// chat_template.jinja with the chat template, generation_config.json),
    /// or its tokenizer.json.
    #[arg(long, value_name = "DIR")]
    tokenizer: PathBuf,
    /// A system prompt.
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// Read the user's turns from FILE, one a line (`-`: stdin), and print
    /// each reply on a line; without it, stdin that is no terminal is read so.
    #[arg(long, value_name = "FILE")]
    prompts: Option<PathBuf>,
    /// New tokens at most, per reply.
    #[arg(long, default_value_t = 256, value_name = "N")]
    max_tokens: usize,
    /// 0: greedy; above 0, sample softmax(logits / T).
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    temperature: f32,
    /// Sample only from the most likely tokens whose probabilities add up to P.
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    top_p: f32,
    /// Seed for sampling (default: from the clock).
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// A token that ends a reply, by id or text; repeatable; replaces the
    /// configured ones (generation_config.json's eos_token_id).
    #[arg(long = "eos", value_name = "TOKEN")]
    eos: Vec<String>,
    /// A text that ends a reply (cut before it); repeatable; added to
    /// generation_config.json's stop_strings.
    #[arg(long = "stop", value_name = "TEXT")]
    stop: Vec<String>,
    #[command(flatten)]
    device: DeviceArgs,
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
            calibrate,
            tokenizer,
        } => {
            let options = CompileOptions {
                backend: match backend {
                    Backend::Metal => compile::Backend::Metal,
                    Backend::Cpu => compile::Backend::Cpu,
                },
                dtype: match dtype {
                    FloatDtype::F32 => DType::F32,
                    FloatDtype::Bf16 => DType::BF16,
                    FloatDtype::F16 => DType::F16,
                },
                quantize: quantize.map(|q| compile::Quantization {
                    options: QuantizeOptions {
                        scheme: match q {
                            Quantize::Int4 => Scheme::Int4,
                            Quantize::Int8 => Scheme::Int8,
                            Quantize::Mixed => Scheme::Mixed,
                        },
                        group_size,
                        skip: quantize_skip,
                    },
                    calibration: calibrate.map(|file| compile::CalibrationText { file, tokenizer }),
                }),
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
                    ..PartitionOptions::default()
                },
                ..CompileOptions::default()
            };
            compile_cmd(
                &mut out,
                model.as_deref(),
                &methods,
                &output,
                &options,
                emit_msl.as_deref(),
            )
        }
        Command::Inspect { model, verbose } => cli::inspect::inspect(&mut out, &model, verbose),
        Command::Generate(args) => generate_cmd(&args),
        Command::Transcribe(args) => transcribe_cmd(&args),
        Command::Chat(args) => chat_cmd(&args),
        Command::Run {
            model,
            method,
            inputs,
            output_dir,
            device,
            bench,
            warmup,
            bench_json,
            trace,
        } => run(
            &mut out,
            &model,
            &method,
            &inputs,
            &output_dir,
            (device, trace),
            bench.map(|runs| Bench {
                runs,
                warmup,
                json: bench_json,
                trace,
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

/// `n` bytes in B, KiB, MiB or GiB.
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

fn compile_cmd(
    out: &mut String,
    path: Option<&Path>,
    extra: &[String],
    output: &Path,
    options: &CompileOptions,
    emit_msl: Option<&Path>,
) -> Result<()> {
    let start = Instant::now();
    let mut files: Vec<(String, PathBuf)> = path
        .map(|p| ("forward".to_string(), p.to_path_buf()))
        .into_iter()
        .collect();
    for m in extra {
        let (name, file) = m
            .split_once('=')
            .ok_or_else(|| Error::invalid_input(format!("--method {m}: expected NAME=FILE.pt2")))?;
        files.push((name.to_string(), PathBuf::from(file)));
    }
    // a bad group size is refused before any model is read
    options.check()?;
    let mut graphs = Vec::with_capacity(files.len());
    for (_, file) in &files {
        graphs.push(etmetal_graph::load_pt2(file)?);
    }
    let methods: Vec<(&str, &etmetal_graph::Graph)> = files
        .iter()
        .zip(&graphs)
        .map(|((name, _), g)| (name.as_str(), g))
        .collect();
    // progress goes to stderr as it happens; the summary to stdout
    let mut progress = |line: &str| eprintln!("etmetal: {line}");
    let in_file = |e: Error| {
        let first = files.first().map(|f| f.1.display().to_string());
        e.context(format!("compiling {}", first.unwrap_or_default()))
    };
    let prepared = compile::prepare(&methods, options, &mut progress).map_err(in_file)?;
    if let Some(q) = &options.quantize {
        // asked to quantize a program with nothing to quantize: refused
        // before any kernel is compiled
        if prepared.linears.iter().all(|&n| n == 0) {
            let where_: Vec<String> = files.iter().map(|(_, f)| f.display().to_string()).collect();
            return Err(Error::invalid_input(format!(
                "--quantize {}: {} {} no linear layer to quantize (no `linear`, and no \
                 `matmul` with a constant weight)",
                q.options.scheme.name(),
                where_.join(", "),
                if where_.len() == 1 { "has" } else { "have" }
            )));
        }
    }
    let lowered = compile::lower_prepared(prepared, options, &mut progress).map_err(in_file)?;
    // written as it is serialized: the file is never whole in memory (an
    // error writing it names the output, as before; a failed check the input)
    let size = lowered.write_file(output).map_err(|e| match e.kind() {
        etmetal_core::ErrorKind::Io => e,
        _ => in_file(e),
    })?;
    say!(
        out,
        "wrote {} ({}) in {:.0} ms",
        output.display(),
        human_bytes(size as usize),
        start.elapsed().as_secs_f64() * 1e3
    );
    let reports = &lowered.reports;
    for m in reports
        .iter()
        .filter(|_| options.backend == compile::Backend::Metal)
    {
        let kernels: usize = m.partitions.iter().map(|p| p.payload.kernels.len()).sum();
        let delegated: usize = m.partitions.iter().map(|p| p.nodes.len()).sum();
        // a one-method program keeps the summary it always had
        let method = match reports.len() {
            1 => String::new(),
            _ => format!("method `{}`: ", m.name),
        };
        say!(
            out,
            "{method}EtMetalBackend: {} partition(s), {delegated} node(s), {kernels} kernel(s); {} node(s) on the cpu",
            m.partitions.len(),
            m.cpu_nodes.len()
        );
        if m.folded_nodes > 0 {
            say!(
                out,
                "  {} node(s) depend on no input: computed at compile time",
                m.folded_nodes
            );
        }
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
        let one = reports.len() == 1;
        for m in reports {
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
    (DeviceArgs { device, coop }, trace): (DeviceArgs, bool),
    bench: Option<Bench>,
) -> Result<()> {
    // a .pte is loaded once: its delegates decide the backend it runs with
    let pte = match etmetal::is_pte(path)? {
        true => Some(etmetal_runtime::Program::load(path)?),
        false => None,
    };
    let workload = pte
        .as_ref()
        .map_or(Workload::Pt2, |p| Workload::of_pte(p.file()));
    let placement = device::choose(device.preference(), path, workload)?;
    if let Some(warning) = &placement.warning {
        eprintln!("etmetal: warning: {warning}");
    }
    let gpu = placement.backend(coop);
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
    // a dynamic input's bounds, and the size it runs at
    for (i, (spec, t)) in model.method_inputs(method)?.iter().zip(&inputs).enumerate() {
        if spec.is_dynamic() {
            say!(
                out,
                "input_{i}: {} {} (dynamic), given {:?}",
                spec.dtype,
                spec.shape_text(),
                t.shape()
            );
        }
    }
    let start = Instant::now();
    let outputs =
        etmetal_runtime::trace::only_if(trace, || model.execute_method(method, inputs.clone()))?;
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
    // (tensor-core forms are chosen per device at load: say where they run)
    let cores = match gpu.as_ref().map_or(0, |b| b.stats().alternatives_chosen) {
        0 => String::new(),
        n => format!(", {n} GPU dispatches in their tensor-core forms"),
    };
    say!(
        out,
        "ran on {place} in {:.3} ms{cores}",
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

/// Load the `.pte` at `path` for `what` (a command's name) on the device
/// `on` asks for: every method, GPU delegates on the adapter chosen.
fn load_pte(path: &Path, what: &str, on: &DeviceArgs) -> Result<Model> {
    load_pte_on(path, what, on).map(|(model, _)| model)
}

/// [`load_pte`], and the GPU backend its delegates run on (if any).
fn load_pte_on(
    path: &Path,
    what: &str,
    on: &DeviceArgs,
) -> Result<(Model, Option<Arc<MetalBackend>>)> {
    if !etmetal::is_pte(path)? {
        return Err(Error::invalid_input(format!(
            "{}: {what} runs a .pte; make one with `etmetal compile`",
            path.display()
        )));
    }
    let program = etmetal_runtime::Program::load(path)?;
    let workload = Workload::of_pte(program.file());
    let placement = device::choose(on.device.preference(), path, workload)?;
    if let Some(warning) = &placement.warning {
        eprintln!("etmetal: warning: {warning}");
    }
    let gpu = placement.backend(on.coop);
    let mut options = etmetal_runtime::LoadOptions::default();
    if let Some(backend) = &gpu {
        options.backends.register(backend.clone())?;
    }
    let model = Model::from_pte_program(program, options)
        .map_err(|e| e.context(path.display().to_string()))?;
    Ok((model, gpu))
}

/// `--seed`, or one from the clock.
fn seed_or_clock(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.map_or(0, |d| d.as_nanos() as u64)
    })
}

/// `--eos` tokens by id or text, or the tokenizer's configured ones.
fn eos_ids(tokenizer: &etmetal::generate::TextTokenizer, eos: &[String]) -> Result<Vec<u32>> {
    match eos.is_empty() {
        true => Ok(tokenizer.eos.clone()),
        false => eos.iter().map(|t| tokenizer.token_id(t)).collect(),
    }
}

fn generate_cmd(args: &GenerateArgs) -> Result<()> {
    use etmetal::generate::{self as gen, TextTokenizer};
    let (mut model, gpu) = load_pte_on(&args.model, "generate", &args.device)?;
    if let Some(dir) = &args.replay {
        return gen::replay(&mut model, dir, args.steps, args.repeat, gpu.as_deref());
    }
    let (Some(tokenizer), Some(prompt)) = (&args.tokenizer, &args.prompt) else {
        return Err(Error::invalid_input("--tokenizer and --prompt are needed"));
    };
    let tokenizer = TextTokenizer::load(tokenizer)?;
    let options = gen::Options {
        max_tokens: args.max_tokens,
        sampling: gen::Sampling {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: seed_or_clock(args.seed),
        },
        eos: eos_ids(&tokenizer, &args.eos)?,
    };
    let stats = gen::generate_text(
        &mut model,
        &tokenizer,
        prompt,
        &options,
        &mut std::io::stdout().lock(),
    )?;
    if stats.cache_full {
        eprintln!("etmetal: generation stopped at the end of the KV cache");
    }
    eprintln!("etmetal: {}", stats.line());
    Ok(())
}

fn transcribe_cmd(args: &TranscribeArgs) -> Result<()> {
    use etmetal::transcribe::{self, Task};
    let start = Instant::now();
    // the audio first: a bad file fails before a GPU is opened
    let audio = etmetal::audio::load_wav(&args.audio, etmetal::audio::SPEECH_RATE)?;
    let mut model = load_pte(&args.model, "transcribe", &args.device)?;
    transcribe::kind(&model).map_err(|e| e.context(args.model.display().to_string()))?;
    let dir = match &args.tokenizer {
        Some(dir) => dir.clone(),
        None => args.model.parent().unwrap_or(Path::new(".")).to_path_buf(),
    };
    let options = transcribe::Options {
        language: args.language.clone(),
        task: match args.task {
            TaskArg::Transcribe => Task::Transcribe,
            TaskArg::Translate => Task::Translate,
        },
        timestamps: args.timestamps,
        ids: args.ids,
        dump_features: args.dump_features.clone(),
    };
    let load = start.elapsed().as_secs_f64();
    let report = transcribe::transcribe(
        &mut model,
        &dir,
        &audio,
        &options,
        &mut std::io::stdout().lock(),
    )?;
    eprintln!("etmetal: {} (load {load:.3} s)", report.line());
    Ok(())
}

fn chat_cmd(args: &ChatArgs) -> Result<()> {
    use etmetal::chat::{self, Chat, ChatOptions};
    use etmetal::generate::{self as gen, TextTokenizer};
    use std::io::{BufRead, IsTerminal, Write};
    let mut model = load_pte(&args.model, "chat", &args.device)?;
    let dir = chat::tokenizer_dir(&args.tokenizer);
    let tokenizer = TextTokenizer::load(&chat::tokenizer_json(&args.tokenizer)?)?;
    let mut stop = chat::configured_stop_strings(&dir)?;
    stop.extend(args.stop.iter().cloned());
    let options = ChatOptions {
        generation: gen::Options {
            max_tokens: args.max_tokens,
            sampling: gen::Sampling {
                temperature: args.temperature,
                top_p: args.top_p,
                seed: seed_or_clock(args.seed),
            },
            eos: eos_ids(&tokenizer, &args.eos)?,
        },
        stop,
        system: args.system.clone(),
    };
    let mut chat = Chat::new(&mut model, &dir, options)?;
    let interactive = args.prompts.is_none() && std::io::stdin().is_terminal();
    let reader: Box<dyn BufRead> = match &args.prompts {
        Some(p) if p.as_os_str() != "-" => Box::new(std::io::BufReader::new(
            std::fs::File::open(p).map_err(|e| Error::io(p.display(), e))?,
        )),
        _ => Box::new(std::io::stdin().lock()),
    };
    if interactive {
        eprintln!(
            "etmetal: chat with {} (an empty line or end of input ends it)",
            args.model.display()
        );
        eprint!("> ");
    }
    let mut stdout = std::io::stdout().lock();
    for line in reader.lines() {
        let line = line.map_err(|e| Error::io("stdin", e))?;
        let text = line.trim_end_matches('\r');
        if text.trim().is_empty() {
            if interactive {
                break;
            }
            continue;
        }
        let (_, stats) = chat.turn(&mut model, text, &mut |piece| {
            stdout
                .write_all(piece.as_bytes())
                .and_then(|()| stdout.flush())
                .map_err(|e| Error::io("stdout", e))
        })?;
        stdout
            .write_all(b"\n")
            .map_err(|e| Error::io("stdout", e))?;
        if stats.decode.cache_full {
            eprintln!("etmetal: the reply stopped at the end of the KV cache");
        }
        eprintln!("etmetal: {}", stats.line());
        if interactive {
            eprint!("> ");
        }
    }
    Ok(())
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
