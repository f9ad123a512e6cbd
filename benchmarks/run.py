"""etmetal benchmarks: GPU ops and models against PyTorch eager CUDA, the CPU
path against ExecuTorch's runtime, compile time, peak memory. BENCHMARKS.md
(README.md here says how) is written from the result JSON by `report`.

    python benchmarks/run.py prepare   # here (torch + executorch venv): .pt2/.pte files -> .bench/
    python benchmarks/run.py cpu       # here: CPU rows, compile time, memory -> results/cpu.json
    python3 benchmarks/run.py gpu      # GPU machine: ops + models vs PyTorch -> results/gpu.json
    python3 benchmarks/run.py report   # results/*.json -> BENCHMARKS.md (+ ratios.png with matplotlib)

Timing: each etmetal figure comes from `etmetal run --bench N --bench-json`
(median of N executes after warm-ups; per-kernel GPU time from timestamp
queries, the sum of every dispatch, median over N profiled executes).
PyTorch is timed with CUDA events around each call, median of N, after
warm-ups; f32 runs with TF32 off. Inputs are random (never zeros or ones).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "parity"))

WORK = REPO / ".bench"  # ignored: models, binary, scratch
RESULTS = HERE / "results"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
RUNS, WARMUP = 20, 5


# ---------------------------------------------------------------- the cases


class Mm(nn.Module):
    def forward(self, a, b):
        return torch.mm(a, b)


class Bmm(nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b)


class Addmm(nn.Module):
    def forward(self, c, a, b):
        return torch.addmm(c, a, b)


class Sdpa(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def conv1d():
    # Whisper large-v3's first layer: 128 mel bins -> 1280 channels, k=3.
    return nn.Conv1d(128, 1280, 3, padding=1)


BMM_BATCH = 4


def op_cases():
    """name -> (module maker, input shapes, flop count, fewest bytes moved per element size)."""
    cases = {}
    for s in (512, 1024, 4096):
        flops = 2 * s**3
        cases[f"mm_{s}"] = (Mm, [(s, s), (s, s)], flops, 3 * s * s)
        cases[f"addmm_{s}"] = (Addmm, [(s,), (s, s), (s, s)], flops, 3 * s * s + s)
        cases[f"bmm_{s}"] = (Bmm, [(BMM_BATCH, s, s)] * 2, BMM_BATCH * flops, BMM_BATCH * 3 * s * s)
    n, cin, length, cout, k = 10, 128, 3000, 1280, 3
    cases["conv1d_128to1280_10x3000"] = (
        conv1d, [(n, cin, length)], 2 * n * cout * length * cin * k,
        n * cin * length + cout * cin * k + n * cout * length)
    for name, q, kv in (("sdpa_1x20x1_kv1500", (1, 20, 1, 64), (1, 20, 1500, 64)),
                        ("sdpa_10x20x1500", (10, 20, 1500, 64), (10, 20, 1500, 64))):
        b, h, sq, d = q
        sk = kv[2]
        cases[name] = (Sdpa, [q, kv, kv], 4 * b * h * sq * sk * d, 2 * b * h * sq * d + 2 * b * h * sk * d)
    return cases


def full_decoder(llama: bool) -> nn.Module:
    """The KV-cache decoders of tests/parity/models/decoders.py at full size:
    Llama-style 1024 wide, 8 layers, GQA 16/4 heads, 32k vocabulary; GPT-2
    small's shape (768 wide, 12 layers, 12 heads, 50257 tokens). Weights
    scaled as the parity suite's `decoder()` does, so logits stay O(1)."""
    from models.decoders import Decoder

    if llama:
        m = Decoder(llama=True, vocab=32000, dim=1024, heads=16, kv_heads=4, layers=8, max_len=DECODE_LEN)
    else:
        m = Decoder(llama=False, vocab=50257, dim=768, heads=12, layers=12, max_len=DECODE_LEN)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.0 / max(1, p.shape[-1] // 8) ** 0.5)
    return m


PREFILL, DECODE_LEN = 128, 256


def model_cases():
    """name -> (module maker, input maker(generator)): the real-models zoo
    (tests/parity/models/) at the issue's full sizes, batch 1. Decoders run
    twice: a prefill of 128 tokens and one decode step at position 128."""
    from models.audio import whisper_tiny
    from models.cnn import MobileNetV2, ResNet
    from models.encoders import bert_base, bert_inputs

    image = lambda g: (torch.randn(1, 3, 224, 224, generator=g),)  # noqa: E731
    tokens = lambda vocab, n, first: lambda g: (  # noqa: E731
        torch.randint(0, vocab, (1, n), generator=g), torch.arange(first, first + n))
    return {
        "resnet18": (ResNet, image),
        "mobilenet_v2": (MobileNetV2, image),
        "bert_base": (bert_base, lambda g: bert_inputs(g, batch=1, vocab=30522)),
        "whisper_tiny_encoder": (whisper_tiny, lambda g: (torch.randn(1, 80, 3000, generator=g),)),
        "llama_prefill128": (lambda: full_decoder(True), tokens(32000, PREFILL, 0)),
        "llama_decode": (lambda: full_decoder(True), tokens(32000, 1, PREFILL)),
        "gpt_prefill128": (lambda: full_decoder(False), tokens(50257, PREFILL, 0)),
        "gpt_decode": (lambda: full_decoder(False), tokens(50257, 1, PREFILL)),
    }


def seed_of(name: str) -> int:
    return sum(name.encode()) * 7919


def make_model(name: str, dtype: str):
    """Module (eval, weights from the name's seed) and its inputs, both in `dtype` where floating."""
    make, inputs = model_cases()[name]
    torch.manual_seed(seed_of(name))
    module = make().eval()
    xs = inputs(torch.Generator().manual_seed(seed_of(name) + 1))
    if dtype == "bf16":
        module = module.to(torch.bfloat16)
        xs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in xs)
    return module, xs


def make_op(name: str, dtype: str, device="cpu", seed=0):
    make, shapes, _, _ = op_cases()[name]
    torch.manual_seed(seed_of(name))
    module = make().eval().to(device=device, dtype=DTYPES[dtype])
    g = torch.Generator(device=device).manual_seed(seed)
    xs = tuple(torch.randn(s, generator=g, device=device).to(DTYPES[dtype]) for s in shapes)
    return module, xs


def weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


# ------------------------------------------------------------- helpers


def binary() -> Path:
    b = os.environ.get("ETMETAL_BIN")
    return Path(b) if b else WORK / "etmetal"


def sh(cmd: list, env=None, timeout=600) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"$ {' '.join(map(str, cmd))}\nexit {r.returncode}\n{r.stderr}{r.stdout}")
    return r


def to_npy(t: torch.Tensor) -> np.ndarray:
    """NumPy has no bf16: bf16 goes as float32 (exact); etmetal rounds it back."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy()


def write_inputs(xs, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, x in enumerate(xs):
        p = folder / f"input_{i}.npy"
        np.save(p, to_npy(x))
        paths.append(p)
    return paths


def etmetal_bench(pte: Path, inputs: list[Path], device: str, runs=RUNS, warmup=WARMUP, env=None) -> dict:
    """`etmetal run --bench` of `pte`: its JSON plus the first output."""
    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "bench.json"
        cmd = [binary(), "run", pte, "--device", device, "--output-dir", d,
               "--bench", runs, "--warmup", warmup, "--bench-json", js]
        if device != "cpu":
            cmd += ["--coop", "auto"]  # tensor cores where the GPU offers them
        if inputs:
            cmd += ["--inputs", ",".join(map(str, inputs))]
        r = sh(cmd, env=env)
        out = json.loads(js.read_text())
        out["stderr"] = r.stderr.strip()
        out["output_0"] = np.load(Path(d) / "output_0.npy")
        return out


def rel_err(got, want: torch.Tensor) -> float:
    got = torch.as_tensor(np.asarray(got), dtype=torch.float64)
    want = want.detach().double().cpu().reshape(got.shape)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def cuda_time_ms(fn, runs=RUNS * 5, warmup=WARMUP * 2) -> float:
    """Median of CUDA-event times around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return median(times)


def runs_for(first_ms: float, budget_ms=20_000) -> tuple[int, int]:
    """Timed runs and warm-ups for a case whose first run took `first_ms`:
    the usual counts, fewer where they would take over `budget_ms`."""
    runs = max(3, min(RUNS, int(budget_ms / max(first_ms, 1e-3))))
    return runs, min(WARMUP, max(1, runs // 4))


def wall_time_ms(fn, runs=RUNS, warmup=WARMUP) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return median(times)


# ------------------------------------------------------------- prepare (here)


def export_save(module, xs, path: Path):
    """`torch.export.export` as users call it, then `run_decompositions({})`,
    which turns in-place buffer updates (the decoders' KV caches) into buffer
    mutations as ExecuTorch's `to_edge` does; no op is decomposed."""
    ep = torch.export.export(copy.deepcopy(module), xs).run_decompositions({})
    torch.export.save(ep, str(path))
    return ep


SUMMARY = re.compile(r"EtMetalBackend: (\d+) partition\(s\), (\d+) node\(s\), (\d+) kernel\(s\); (\d+) node\(s\) on the cpu")


def compile_for_gpu(pt2: Path, pte: Path) -> dict:
    """`etmetal compile` for the H200 (tensors up to 2 GiB on the GPU): seconds and the delegation summary."""
    t = time.perf_counter()
    r = sh([binary(), "compile", pt2, "-o", pte, "--max-buffer", "2G"])
    secs = time.perf_counter() - t
    m = SUMMARY.search(r.stdout)
    parts, nodes, kernels, cpu = (int(x) for x in m.groups()) if m else (0, 0, 0, -1)
    return {"compile_s": secs, "partitions": parts, "delegated_nodes": nodes, "kernels": kernels, "cpu_nodes": cpu}


def prepare(args):
    """Export every op (.pt2) and compile it for the GPU (.pte); export the f32 models for the CPU rows."""
    (WORK / "ops").mkdir(parents=True, exist_ok=True)
    (WORK / "models").mkdir(parents=True, exist_ok=True)
    for name in op_cases():
        for dt in DTYPES:
            # Shapes only matter to export; the GPU run draws its own inputs.
            module, xs = make_op(name, dt)
            pt2 = WORK / "ops" / f"{name}.{dt}.pt2"
            export_save(module, xs, pt2)
            compile_for_gpu(pt2, pt2.with_suffix(".pte"))
            pt2.unlink()  # the GPU machine needs the .pte only
    # Models are exported where they run: full-size .pte files are too big
    # to carry to the GPU machine. The CPU rows take these f32 exports.
    (WORK / "pt2").mkdir(exist_ok=True)
    for name in model_cases():
        module, xs = make_model(name, "f32")
        export_save(module, xs, WORK / "pt2" / f"{name}.f32.pt2")
    print(f"prepared {WORK}")


# ------------------------------------------------------------- cpu (here)


def cpu_info() -> dict:
    model = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                  if l.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__}


def et_lower(pt2: Path, xnnpack: bool) -> tuple[bytes, float]:
    """ExecuTorch's lowering of `pt2` (portable kernels or XNNPACK): the .pte bytes and seconds taken."""
    from executorch.exir import to_edge, to_edge_transform_and_lower

    t = time.perf_counter()
    ep = torch.export.load(str(pt2))
    # no autograd: the lowering passes run the buffer write-backs (`copy_`) eagerly
    with torch.no_grad():
        if xnnpack:
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            prog = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        else:
            prog = to_edge(ep).to_executorch()
    return prog.buffer, time.perf_counter() - t


def et_bench(pte_bytes: bytes, xs) -> tuple[float, torch.Tensor]:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte_bytes)  # kept alive while the method runs
    method = program.load_method("forward")
    run = lambda: method.execute(list(xs))  # noqa: E731
    t = time.perf_counter()
    out = run()[0]
    return wall_time_ms(run, *runs_for((time.perf_counter() - t) * 1e3)), out


def resumed(args) -> tuple[dict, callable]:
    """Rows of an earlier, interrupted run (`--resume`: its log of JSON
    lines) by (case, dtype), and whether `--only` asks for a case."""
    done = {}
    for line in Path(args.resume).read_text().splitlines() if args.resume else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[(row.get("op") or row.get("model"), row.get("dtype", "f32"))] = row
    return done, lambda name: not args.only or any(name.startswith(p) for p in args.only.split(","))


def cpu(args):
    threads = os.cpu_count()
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    rows = []
    done, wanted = resumed(args)
    for name in model_cases():
        if (name, "f32") in done or not wanted(name):
            rows.extend([done[name, "f32"]] if (name, "f32") in done else [])
            continue
        module, xs = make_model(name, "f32")
        pt2 = WORK / "pt2" / f"{name}.f32.pt2"
        with torch.no_grad():
            want = as_tuple(module(*xs))[0]
        row = {"model": name, "weight_bytes": weight_bytes(module)}
        # compile time: etmetal (both backends) vs ExecuTorch lowerings, same .pt2
        cpu_pte = WORK / "models" / f"{name}.cpu.pte"
        for backend in ("cpu", "metal"):
            t = time.perf_counter()
            sh([binary(), "compile", pt2, "-o", cpu_pte if backend == "cpu" else WORK / "scratch.pte",
                "--backend", backend], env=env)
            row[f"compile_s_etmetal_{backend}"] = time.perf_counter() - t
        inputs = write_inputs(xs, WORK / "inputs" / name)
        first = etmetal_bench(cpu_pte, inputs, "cpu", runs=1, warmup=0, env=env)["latency_ms"]["median"]
        runs, warmup = runs_for(first)
        b = etmetal_bench(cpu_pte, inputs, "cpu", runs=runs, warmup=warmup, env=env)
        row.update(runs=runs, etmetal_ms=b["latency_ms"]["median"], etmetal_err=rel_err(b["output_0"], want),
                   peak_rss_after_load=b["peak_rss_after_load_bytes"], peak_rss=b["peak_rss_bytes"])
        for kind, xnn in (("portable", False), ("xnnpack", True)):
            try:
                data, secs = et_lower(pt2, xnn)
                row[f"compile_s_et_{kind}"] = secs
                ms, got = et_bench(data, xs)
                row[f"et_{kind}_ms"] = ms
                row[f"et_{kind}_err"] = rel_err(got.numpy(), want)
            except Exception as e:  # a lowering or runtime refusal is a row, not a crash
                row[f"et_{kind}_error"] = f"{type(e).__name__}: {e}"[:200]
        print(json.dumps(row), flush=True)
        rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu.json").write_text(json.dumps({"machine": cpu_info(), "threads": threads, "runs": RUNS,
                                                  "warmup": WARMUP, "models": rows}, indent=1) + "\n")


# ------------------------------------------------------------- gpu (H200)


def gpu_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return {"gpu": p.name, "sms": p.multi_processor_count, "nvidia_smi": smi, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpu": cpu_info()["cpu"], "cores": os.cpu_count()}


def gpu_op(name: str, dt: str, scratch: Path) -> dict:
    _, _, flops, elems = op_cases()[name]
    module, xs = make_op(name, dt, device="cuda", seed=1)
    with torch.no_grad():
        torch_ms = cuda_time_ms(lambda: module(*xs))
        # reference in f64 from the same (rounded) inputs
        ref = module.double()(*(x.double() for x in xs)) if dt == "f32" else \
            module.float()(*(x.float() for x in xs))
    # Above 64 MiB of operands an execute spends most of its time converting
    # and copying on the host (see the e2e column): fewer runs keep the whole
    # harness inside one device call.
    big = elems * DTYPES[dt].itemsize > 64 << 20
    b = etmetal_bench(WORK / "ops" / f"{name}.{dt}.pte", write_inputs(xs, scratch / name), "auto",
                      runs=5 if big else RUNS, warmup=2 if big else WARMUP)
    gpu = b.get("gpu") or {}
    kernel_ms = gpu.get("total_ms_median")
    size = DTYPES[dt].itemsize
    return {"op": name, "dtype": dt, "flops": flops, "bytes": elems * size, "torch_ms": torch_ms,
            "etmetal_kernel_ms": kernel_ms, "etmetal_e2e_ms": b["latency_ms"]["median"],
            "dispatches": len(gpu.get("dispatches", [])), "gpu_timing": gpu.get("unavailable"),
            "err": rel_err(b["output_0"], ref), "adapter": b["device"]}


def torch_compiled_ms(m, xs) -> dict:
    """`torch.compile` (default mode) of `m`: the first call's seconds (compilation) and the CUDA-event median."""
    try:
        cm = torch.compile(m)
        t = time.perf_counter()
        cm(*xs)
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        return {"torch_compile_ms": cuda_time_ms(lambda: cm(*xs)), "torch_compile_first_s": first}
    except Exception as e:  # a compile failure is a figure, not a crash
        return {"torch_compile_error": f"{type(e).__name__}: {e}"[:300]}


def gpu_model(name: str, dt: str, scratch: Path) -> dict:
    module, xs = make_model(name, dt)
    pt2, pte = scratch / f"{name}.{dt}.pt2", scratch / f"{name}.{dt}.pte"
    export_save(module, xs, pt2)
    compiled = compile_for_gpu(pt2, pte)
    pt2.unlink()
    cuda_xs = tuple(x.cuda() for x in xs)
    m = module.cuda()
    with torch.no_grad():
        # decoders write the same cache slot every call, so outputs repeat
        want = as_tuple(m(*cuda_xs))[0]
        torch_ms = cuda_time_ms(lambda: m(*cuda_xs))
        # what a caller sees: inputs up, run, outputs down
        torch_e2e = wall_time_ms(lambda: [o.cpu() for o in as_tuple(m(*(x.cuda() for x in xs)))])
        compiled_torch = torch_compiled_ms(copy.deepcopy(m), cuda_xs)
    b = etmetal_bench(pte, write_inputs(xs, scratch / name), "auto")
    pte.unlink()
    gpu = b.get("gpu") or {}
    top = sorted(gpu.get("dispatches", []), key=lambda k: -k["median_ms"])[:3]
    return {"model": name, "dtype": dt, "weight_bytes": weight_bytes(module), "torch_ms": torch_ms,
            "torch_e2e_ms": torch_e2e, **compiled_torch, **compiled,
            "etmetal_e2e_ms": b["latency_ms"]["median"],
            "etmetal_kernel_ms": gpu.get("total_ms_median"), "dispatches": len(gpu.get("dispatches", [])),
            "top_kernels": [{"kernel": k["kernel"], "ms": k["median_ms"], "share": k["share"]} for k in top],
            "peak_rss": b["peak_rss_bytes"], "peak_rss_after_load": b["peak_rss_after_load_bytes"],
            "err": rel_err(b["output_0"], want)}


def gpu(args):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ops, models = [], []
    done, wanted = resumed(args)
    with tempfile.TemporaryDirectory() as d:
        for name in op_cases():
            for dt in DTYPES:
                if (name, dt) in done or not wanted(name):
                    ops.extend([done[name, dt]] if (name, dt) in done else [])
                    continue
                try:
                    ops.append(gpu_op(name, dt, Path(d)))
                except Exception as e:  # one failing case is a row with its error
                    ops.append({"op": name, "dtype": dt, "error": str(e)[-400:]})
                print(json.dumps(ops[-1]), flush=True)
        for name in model_cases():
            for dt in DTYPES:
                if (name, dt) in done or not wanted(name):
                    models.extend([done[name, dt]] if (name, dt) in done else [])
                    continue
                try:
                    models.append(gpu_model(name, dt, Path(d)))
                except Exception as e:
                    models.append({"model": name, "dtype": dt, "error": str(e)[-400:]})
                print(json.dumps(models[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / "gpu.json"
    out.write_text(json.dumps({"machine": gpu_info(), "runs": RUNS, "warmup": WARMUP, "ops": ops,
                               "models": models}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prepare", "cpu", "gpu", "report"])
    ap.add_argument("--out", help="gpu: where to write the JSON (default results/gpu.json)")
    ap.add_argument("--resume", help="cpu/gpu: keep the rows of this earlier run's log, measure the rest")
    ap.add_argument("--only", help="cpu/gpu: measure only the ops/models whose names start with one of these (comma-separated)")
    a = ap.parse_args()
    if a.step == "report":
        import report

        report.main()
    else:
        {"prepare": prepare, "cpu": cpu, "gpu": gpu}[a.step](a)
