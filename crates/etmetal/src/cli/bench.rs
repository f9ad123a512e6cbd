//! `etmetal run --bench`: latency figures over timed executes and, where
//! the GPU has timestamp queries, each dispatch's GPU time.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use etmetal::Model;
use etmetal_core::{Error, Result, Tensor};
use etmetal_metal_runtime::MetalBackend;

/// `run --bench`: how many timed and warm-up executes, where to write JSON.
pub struct Bench {
    pub runs: usize,
    pub warmup: usize,
    pub json: Option<PathBuf>,
    /// Trace one more execute after the timed ones (`run --trace`).
    pub trace: bool,
}

/// The `q` quantile (nearest rank) of sorted `v`.
fn quantile(v: &[f64], q: f64) -> f64 {
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The process's peak resident set so far, in bytes (Linux `VmHWM`; `None`
/// where /proc is absent).
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    kib.trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

/// `inputs` as the method takes them, made once before timing: cast to
/// its declared dtypes (f32 `.npy` files for a bf16 model) and shared, so
/// that each timed execute's `to_vec` counts references instead of copying
/// every input byte (PyTorch's side of a comparison passes its tensors).
fn shared_inputs(model: &Model, method: &str, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let specs = model.method_inputs(method)?;
    etmetal_core::check_inputs(&specs, inputs.to_vec())?
        .into_iter()
        .map(|t| Tensor::from_shared(t.dtype(), t.shape(), Arc::new(t.bytes().to_vec()), 0))
        .collect()
}

/// Time `bench.runs` executes after `bench.warmup`; then, where the GPU has
/// timestamp queries, as many profiled executes for per-kernel GPU times
/// (apart, since a profiled execute gives each dispatch its own pass).
/// Prints the figures and returns them as JSON.
pub fn bench_model(
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
    let inputs = &shared_inputs(model, method, inputs)?;
    for _ in 0..warmup {
        model.execute_method(method, inputs.to_vec())?;
    }
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        model.execute_method(method, inputs.to_vec())?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    etmetal_runtime::trace::only_if(bench.trace, || {
        model.execute_method(method, inputs.to_vec())
    })?;
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
