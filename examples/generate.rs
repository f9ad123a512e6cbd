//! A small decoder loop on a compiled `.pte` whose `forward(tokens, input_pos)`
//! takes one token (`tokens` int64 `[1, 1]`, `input_pos` int64 `[1]`), keeps
//! its KV cache in mutable buffers and returns logits `[1, 1, vocab]`:
//! prefill of the prompt, then greedy decode, with tokens/s. When the file
//! has a `prefill` method (`tokens [1, P]`, `input_pos [P]`, compiled with
//! `etmetal compile decode.pt2 --method prefill=prefill.pt2`), the prompt
//! of P tokens is prefilled in one call; otherwise token by token.
//!
//! ```text
//! cargo run --release -p etmetal --example generate -- MODEL.pte [--device auto|cpu]
//!     [--prompt 1,2,3] [--tokens N]
//! cargo run --release -p etmetal --example generate -- MODEL.pte --replay DIR --steps N [--repeat R]
//! ```
//! `--replay` runs any stateful program step by step: it reads
//! `DIR/step{k}_input{i}.npy` (and the method's name from
//! `DIR/step{k}_method.txt`, `forward` without it) and writes
//! `DIR/step{k}_output{i}.npy` for `k < N`, all through one loaded model
//! (what the parity suite compares with eager PyTorch at every step). With
//! `--repeat R` the state is reset and the steps run again, R times in
//! all, run r > 0 writing `DIR/run{r}_step{k}_output{i}.npy`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use etmetal::Model;
use etmetal_core::{npy, DType, Error, Result, Tensor};
use etmetal_metal_runtime::{select_adapter, DeviceChoice, MetalBackend};

struct Args {
    model: PathBuf,
    gpu: bool,
    prompt: Vec<i64>,
    /// Whether `--prompt` was given (else the prompt fits the prefill method).
    prompt_given: bool,
    tokens: usize,
    replay: Option<(PathBuf, usize)>,
    repeat: usize,
}

fn parse_args() -> Result<Args> {
    let bad = |m: String| Error::invalid_input(m);
    let mut it = std::env::args().skip(1);
    let mut model = None;
    let mut args = Args {
        model: PathBuf::new(),
        gpu: true,
        prompt: vec![1, 2, 3, 4],
        prompt_given: false,
        tokens: 32,
        replay: None,
        repeat: 1,
    };
    let mut replay_dir = None;
    let mut steps = 1;
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| bad(format!("{a} needs a value")));
        match a.as_str() {
            "--device" => match value()?.as_str() {
                "auto" => args.gpu = true,
                "cpu" => args.gpu = false,
                d => return Err(bad(format!("--device {d}: auto or cpu"))),
            },
            "--prompt" => {
                args.prompt_given = true;
                args.prompt = value()?
                    .split(',')
                    .map(|t| t.trim().parse().map_err(|_| bad(format!("token `{t}`"))))
                    .collect::<Result<_>>()?
            }
            "--tokens" => {
                args.tokens = value()?
                    .parse()
                    .map_err(|_| bad("--tokens: a count".into()))?
            }
            "--replay" => replay_dir = Some(PathBuf::from(value()?)),
            "--steps" => {
                steps = value()?
                    .parse()
                    .map_err(|_| bad("--steps: a count".into()))?
            }
            "--repeat" => {
                args.repeat = value()?
                    .parse()
                    .map_err(|_| bad("--repeat: a count".into()))?
            }
            _ if model.is_none() && !a.starts_with('-') => model = Some(PathBuf::from(&a)),
            _ => return Err(bad(format!("unexpected argument `{a}`"))),
        }
    }
    args.model = model.ok_or_else(|| bad("usage: generate MODEL.pte [options]".into()))?;
    args.replay = replay_dir.map(|d| (d, steps));
    if args.prompt.is_empty() {
        return Err(bad("--prompt is empty".into()));
    }
    Ok(args)
}

/// The model and, when it runs on a GPU, its backend (for its counters).
fn load(path: &Path, gpu: bool) -> Result<(Model, Option<Arc<MetalBackend>>)> {
    let mut options = etmetal_runtime::LoadOptions::default();
    if gpu {
        match select_adapter(DeviceChoice::Auto) {
            Ok((_, adapter)) => {
                eprintln!("generate: GPU adapter {}", adapter.get_info().name);
                let backend = Arc::new(MetalBackend::new(DeviceChoice::Auto));
                options.backends.register(backend.clone())?;
                return Ok((Model::load_with(path, options)?, Some(backend)));
            }
            Err(e) => eprintln!("generate: no GPU ({}), running on the cpu", e.message()),
        }
    }
    Ok((Model::load_with(path, options)?, None))
}

fn replay(model: &mut Model, dir: &Path, steps: usize, repeat: usize) -> Result<()> {
    for r in 0..repeat {
        if r > 0 {
            model.reset_state()?;
        }
        let run = if r == 0 {
            String::new()
        } else {
            format!("run{r}_")
        };
        for k in 0..steps {
            let file = dir.join(format!("step{k}_method.txt"));
            let method = match std::fs::read_to_string(&file) {
                Ok(name) => name.trim().to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => "forward".to_string(),
                Err(e) => return Err(Error::io(file.display(), e)),
            };
            let inputs = (0..model.method_inputs(&method)?.len())
                .map(|i| npy::read(&dir.join(format!("step{k}_input{i}.npy"))))
                .collect::<Result<Vec<_>>>()?;
            let outputs = model
                .execute_method(&method, inputs)
                .map_err(|e| e.context(format!("step {k} (method `{method}`)")))?;
            for (i, t) in outputs.iter().enumerate() {
                npy::write(&dir.join(format!("{run}step{k}_output{i}.npy")), t)?;
            }
        }
    }
    Ok(())
}

/// Index of the largest of the last position's logits.
fn argmax_last(logits: &Tensor) -> Result<i64> {
    let vocab = *logits
        .shape()
        .last()
        .ok_or_else(|| Error::shape("logits are 0-d"))?;
    let values = logits.to_f64_vec();
    let last = values
        .get(values.len().saturating_sub(vocab)..)
        .filter(|l| !l.is_empty())
        .ok_or_else(|| Error::shape("no logits"))?;
    let best = last
        .iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > last[b] { i } else { b });
    Ok(best as i64)
}

fn step(model: &mut Model, token: i64, pos: i64) -> Result<i64> {
    let inputs = vec![
        Tensor::from_i64(DType::I64, &[1, 1], &[token])?,
        Tensor::from_i64(DType::I64, &[1], &[pos])?,
    ];
    let outputs = model
        .execute(inputs)
        .map_err(|e| e.context(format!("position {pos}")))?;
    argmax_last(outputs.first().ok_or_else(|| Error::shape("no output"))?)
}

/// The prompt length the `prefill` method takes (its `tokens` are `[1, P]`).
fn prefill_len(model: &Model) -> Result<Option<usize>> {
    if !model.has_method("prefill") {
        return Ok(None);
    }
    match model
        .method_inputs("prefill")?
        .first()
        .map(|s| s.shape.as_slice())
    {
        Some(&[1, p]) => Ok(Some(p)),
        other => Err(Error::shape(format!(
            "method `prefill` takes tokens of shape {other:?}, not [1, P]"
        ))),
    }
}

fn generate(
    model: &mut Model,
    gpu: Option<&MetalBackend>,
    prompt: &[i64],
    tokens: usize,
) -> Result<()> {
    let t0 = Instant::now();
    let mut next = 0;
    let one_call = prefill_len(model)? == Some(prompt.len());
    if one_call {
        let n = prompt.len();
        let positions: Vec<i64> = (0..n as i64).collect();
        let inputs = vec![
            Tensor::from_i64(DType::I64, &[1, n], prompt)?,
            Tensor::from_i64(DType::I64, &[n], &positions)?,
        ];
        let outputs = model
            .execute_method("prefill", inputs)
            .map_err(|e| e.context("prefill"))?;
        next = argmax_last(outputs.first().ok_or_else(|| Error::shape("no output"))?)?;
    } else {
        for (pos, &t) in prompt.iter().enumerate() {
            next = step(model, t, pos as i64)?;
        }
    }
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let before = gpu.map(MetalBackend::stats);
    let mut out = vec![next];
    for k in 1..tokens {
        next = step(model, next, (prompt.len() + k - 1) as i64)?;
        out.push(next);
    }
    let decode = t1.elapsed().as_secs_f64();
    let list: Vec<String> = out.iter().map(i64::to_string).collect();
    println!("tokens: {}", list.join(" "));
    println!(
        "prefill: {} tokens in {:.3} s ({:.1} tokens/s, {})",
        prompt.len(),
        prefill,
        prompt.len() as f64 / prefill,
        if one_call {
            "one call of `prefill`"
        } else {
            "token by token"
        }
    );
    println!(
        "decode: {} tokens in {:.3} s ({:.1} tokens/s)",
        tokens.saturating_sub(1),
        decode,
        tokens.saturating_sub(1) as f64 / decode.max(1e-9)
    );
    if let (Some(gpu), Some(before), n @ 1..) = (gpu, before, tokens.saturating_sub(1)) {
        let after = gpu.stats();
        println!(
            "decode: per step {} B written to the GPU, {} B read back",
            (after.bytes_uploaded - before.bytes_uploaded) / n as u64,
            (after.bytes_read_back - before.bytes_read_back) / n as u64
        );
    }
    Ok(())
}

fn main() {
    let result = parse_args().and_then(|args| {
        let (mut model, gpu) = load(&args.model, args.gpu)?;
        match &args.replay {
            Some((dir, steps)) => replay(&mut model, dir, *steps, args.repeat),
            None => {
                // without --prompt, a prompt the prefill method takes whole
                let prompt = match prefill_len(&model)? {
                    Some(p) if !args.prompt_given => (0..p as i64).map(|k| 1 + k % 16).collect(),
                    Some(p) if args.prompt.len() != p => {
                        eprintln!(
                            "generate: the prompt has {} tokens, `prefill` takes {p}: prefilling token by token",
                            args.prompt.len()
                        );
                        args.prompt.clone()
                    }
                    _ => args.prompt.clone(),
                };
                generate(&mut model, gpu.as_deref(), &prompt, args.tokens)
            }
        }
    });
    if let Err(e) = result {
        eprintln!("generate: {e}");
        std::process::exit(if e.kind() == etmetal_core::ErrorKind::Internal {
            1
        } else {
            2
        });
    }
}
