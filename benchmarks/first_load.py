"""The first-load cost of `--coop auto`: the first time a payload loads on
an adapter, every dispatch with tensor-core alternatives is timed in each
form and the choice is cached on disk (crates/etmetal-metal-runtime/src/
select.rs); later loads read the cache. This measures what that costs a
user, per model (bf16, batch 1: the Whisper-tiny encoder and torchvision's
ViT-B/16 of run.py's model rows), as the wall time of one `etmetal run`
process (load + first execute) in four configurations:

    off      --coop off: portable kernels only, nothing measured
    nocache  --coop auto, ETMETAL_TUNING_CACHE=off: every load measures
    cold     --coop auto, an empty new cache directory (ETMETAL_CACHE_DIR)
    warm     --coop auto, the cold run's directory again: nothing measured

    ETMETAL_BIN=.bench/etmetal python3 benchmarks/first_load.py --out first_load.json
    python benchmarks/first_load.py --smoke      # a tiny stand-in (lavapipe, CPU machines)

Each configuration runs REPEAT (3) fresh processes, interleaved (off,
nocache, cold i, warm i on cold i's directory): the JSON holds the median
and [min, max] of the wall time, of the first execute (`run`'s "ran on ...
in X ms") and of their difference (load, process and device start-up
included: `run` prints no load time), and how many dispatches ran in a
tensor-core form. Before the timed runs, one untimed `off` and one `nocache`
run per model compile every pipeline once, so the driver's own shader cache
(NVIDIA's ~/.nv/GLCache, Mesa's) is as warm for every configuration (their
times are kept as `driver_warmup`). Then one more cold and one more warm run
with `ETMETAL_TRACE=1` (`--trace` alone starts tracing after the load, when
the forms are measured already): the host trace, with its "gpu: measure the
kernels' forms" span, and the cold cache file's choices (per dispatch
signature: the form picked, null for the portable kernel, and the
milliseconds of each form timed). Every subprocess has a timeout and the
whole run a deadline (--deadline): what it leaves out is named in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (the harness: model rows, export, binary)

MODELS = ("whisper_tiny_encoder", "vit_b16")
CONFIGS = ("off", "nocache", "cold", "warm")
RAN = re.compile(r"^ran on (.*?) in ([\d.]+) ms(?:, (\d+) GPU dispatches in their tensor-core forms)?$", re.M)
MEASURE = "gpu: measure the kernels' forms"
NOTES = ("wall_ms: one `etmetal run` process, start to exit; execute_ms: its first execute ('ran on ... in X "
         "ms'); load_ms: wall_ms - execute_ms (process and device start-up, program load, forms measured, "
         "output files written: `run` prints no load time); coop_dispatches: dispatches in a tensor-core form")
TRACE_KEEP = 80  # trace lines kept in the JSON (the whole trace goes beside it)


class Deadline(Exception):
    pass


class Clock:
    """The run's deadline: each step asks for time before it starts."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def need(self, seconds: float, what: str):
        if self.left() < seconds:
            raise Deadline(f"{what}: {self.left():.0f} s left of the deadline, {seconds:.0f} needed")


def smoke_model():
    """A Whisper-style encoder (tests/parity/models/audio.py) small enough
    for lavapipe: 2 blocks, 64 wide, 64 mel frames, bf16."""
    import torch
    from models.audio import AudioEncoder

    torch.manual_seed(0)
    m = AudioEncoder(mels=80, frames=64, dim=64, heads=4, layers=2).eval().to(torch.bfloat16)
    x = torch.randn(1, 80, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    return m, (x,)


def with_alarm(seconds: int, what: str, fn):
    """`fn()` bounded by SIGALRM (in-process work: the export)."""
    def fire(*_):
        raise TimeoutError(f"{what} took over {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(max(1, int(seconds)))
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def sh(cmd: list, env: dict, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd` with `env` added, bounded by `timeout` (killed past it):
    the result and its wall milliseconds; a failure raises."""
    start = time.perf_counter()
    try:
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"$ {' '.join(map(str, cmd))}: killed after {timeout:.0f} s") from e
    ms = (time.perf_counter() - start) * 1e3
    if r.returncode != 0:
        raise RuntimeError(f"$ {' '.join(map(str, cmd))}\nexit {r.returncode}\n{r.stderr[-2000:]}{r.stdout[-1000:]}")
    return r, ms


def prepare(name: str, smoke: bool, scratch: Path, clock: Clock, timeout: float) -> dict:
    """Export `name` in bf16 (run.py's maker and export), compile it for the
    GPU (`--max-buffer 2G`), write its inputs: the .pte, the inputs and
    the export and compile seconds."""
    clock.need(30, f"exporting {name}")
    t = time.perf_counter()
    module, xs = smoke_model() if smoke else run.make_model(name, "bf16")
    pt2 = scratch / f"{name}.pt2"
    with_alarm(min(timeout, clock.left()), f"exporting {name}", lambda: run.export_save(module, xs, pt2))
    export_s = time.perf_counter() - t
    del module
    inputs = run.write_inputs(xs, scratch / f"{name}-in")
    pte = scratch / f"{name}.pte"
    r, ms = sh([run.binary(), "compile", pt2, "-o", pte, "--max-buffer", "2G"], {}, min(timeout, clock.left()))
    pt2.unlink()
    m = run.SUMMARY.search(r.stdout)
    summary = dict(zip(("partitions", "delegated_nodes", "kernels", "cpu_nodes"), map(int, m.groups()))) if m else {}
    return {"pte": pte, "inputs": inputs, "export_s": round(export_s, 2), "compile_s": round(ms / 1e3, 2),
            "pte_bytes": pte.stat().st_size, **summary}


def etmetal_run(case: dict, device: str, coop: str, env: dict, scratch: Path, timeout: float,
                trace=False) -> dict:
    """One `etmetal run` process: its wall and first-execute milliseconds,
    the adapter and the dispatches in a tensor-core form (its stderr too,
    where `trace`)."""
    out = Path(tempfile.mkdtemp(dir=scratch, prefix="out-"))
    cmd = [run.binary(), "run", case["pte"], "--device", device, "--coop", coop,
           "--inputs", ",".join(map(str, case["inputs"])), "--output-dir", out]
    if trace:
        cmd.append("--trace")
        env = {**env, "ETMETAL_TRACE": "1"}
    try:
        r, wall = sh(cmd, env, timeout)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    m = RAN.search(r.stdout)
    if not m:
        raise RuntimeError(f"no 'ran on' line in the output of {' '.join(map(str, cmd))}:\n{r.stdout[-1000:]}")
    execute = float(m.group(2))
    row = {"wall_ms": round(wall, 1), "execute_ms": round(execute, 2), "load_ms": round(wall - execute, 1),
           "coop_dispatches": int(m.group(3) or 0), "adapter": m.group(1)}
    if trace:
        row["stderr"] = r.stderr
    return row


def cache_env(config: str, cache_dir: Path) -> dict:
    """Each configuration's environment: a cache directory of its own (the
    user's ~/.cache/etmetal is never read nor written)."""
    env = {"ETMETAL_CACHE_DIR": str(cache_dir), "ETMETAL_TUNING_CACHE": ""}
    if config == "nocache":
        env["ETMETAL_TUNING_CACHE"] = "off"
    return env


def cache_choices(cache_dir: Path) -> list[dict]:
    """The tuning cache files under `cache_dir` (select.rs's TuningCache:
    tuning/<adapter>-<payload>.json, {"choices": {sig: {"pick", "ms"}}})."""
    files = []
    for f in sorted((cache_dir / "tuning").glob("*.json")):
        try:
            choices = json.loads(f.read_text()).get("choices", {})
        except (OSError, ValueError) as e:
            files.append({"file": f.name, "error": str(e)})
            continue
        files.append({"file": f.name, "signatures": len(choices),
                      "alternative_picked": sum(c.get("pick") is not None for c in choices.values()),
                      "choices": choices})
    return files


def spread(rows: list[dict], key: str) -> dict:
    v = [r[key] for r in rows]
    return {"median": round(statistics.median(v), 2), "min": min(v), "max": max(v), "all": v} if v else {}


def trace_summary(stderr: str) -> dict:
    """A traced run's host trace: the measuring span's milliseconds, the
    lines naming forms (measured, left out), the first TRACE_KEEP lines."""
    lines = [l for l in stderr.splitlines() if l.startswith("trace:")]
    measure = [l for l in lines if MEASURE in l]
    ms = float(measure[0].split()[1]) if measure else None
    return {"measure_ms": ms, "lines": len(lines),
            "form_lines": [l for l in lines if "form" in l][:TRACE_KEEP],
            "head": lines[:TRACE_KEEP], "other_stderr": [l for l in stderr.splitlines() if not l.startswith("trace:")][:20]}


def measure_model(name: str, args, scratch: Path, clock: Clock, out_dir: Path) -> dict:
    case = prepare(name, args.smoke, scratch, clock, args.timeout)
    row = {"model": name if not args.smoke else f"smoke({name})", "dtype": "bf16",
           **{k: v for k, v in case.items() if k not in ("pte", "inputs")}}
    print(f"{name}: exported in {case['export_s']} s, compiled in {case['compile_s']} s "
          f"({case.get('kernels')} kernels, {case.get('cpu_nodes')} cpu nodes)", flush=True)
    caches = scratch / f"{name}-caches"
    one = lambda config, cache, trace=False: etmetal_run(  # noqa: E731
        case, args.device, "off" if config == "off" else "auto", cache_env(config, cache), scratch,
        min(args.timeout, max(1.0, clock.left())), trace)
    per_run = 2 * args.run_seconds
    skipped, runs = [], {c: [] for c in CONFIGS}
    try:
        # the driver's shader cache, warm for every configuration alike
        clock.need(per_run, f"{name}: driver warm-up")
        row["driver_warmup"] = {c: one(c, caches / f"warmup-{c}") for c in ("off", "nocache")}
        for i in range(args.repeat):
            for config in CONFIGS:
                clock.need(per_run, f"{name}: {config} run {i}")
                # warm i reads what cold i wrote; the others start empty
                cache = caches / (f"cold-{i}" if config in ("cold", "warm") else f"{config}-{i}")
                if config == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                runs[config].append(one(config, cache))
                r = runs[config][-1]
                print(f"  {config:8} run {i}: wall {r['wall_ms']:9.1f} ms, first execute {r['execute_ms']:9.2f} ms, "
                      f"{r['coop_dispatches']} tensor-core dispatches", flush=True)
        # one traced cold run and the warm one after it: the measuring span
        clock.need(2 * per_run, f"{name}: traced runs")
        traced = caches / "traced"
        shutil.rmtree(traced, ignore_errors=True)
        cold_t, warm_t = one("cold", traced, True), one("warm", traced, True)
        for tag, t in (("cold", cold_t), ("warm", warm_t)):
            (out_dir / f"first_load.{name}.{tag}.trace.txt").write_text(t.pop("stderr"))
        row["traced"] = {"cold": {**cold_t, **trace_summary((out_dir / f"first_load.{name}.cold.trace.txt").read_text())},
                         "warm": {**warm_t, **trace_summary((out_dir / f"first_load.{name}.warm.trace.txt").read_text())},
                         "files": [f"first_load.{name}.{t}.trace.txt" for t in ("cold", "warm")]}
        row["cache_after_cold"] = cache_choices(traced)
    except Deadline as e:
        skipped.append(str(e))
    except Exception as e:  # a failing model is a row with its error
        row["error"] = str(e)[-1500:]
    finally:
        shutil.rmtree(caches, ignore_errors=True)
        case["pte"].unlink(missing_ok=True)
    row["adapter"] = next((r["adapter"] for rs in runs.values() for r in rs), None)
    row["configs"] = {c: {"runs": len(rs), **{k: spread(rs, k) for k in ("wall_ms", "execute_ms", "load_ms")},
                          "coop_dispatches": sorted({r["coop_dispatches"] for r in rs})}
                      for c, rs in runs.items() if rs}
    off = row["configs"].get("off", {}).get("wall_ms", {}).get("median")
    row["extra_wall_vs_off_ms"] = {c: round(v["wall_ms"]["median"] - off, 1)
                                   for c, v in row["configs"].items() if off is not None and c != "off"}
    if skipped:
        row["skipped"] = skipped
    return row


def card() -> dict:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        smi = None
    try:
        version = subprocess.run([str(run.binary()), "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        version = None
    import torch
    return {"nvidia_smi": smi, "etmetal": version, "binary": str(run.binary()), "torch": torch.__version__,
            "cores": os.cpu_count()}


def table(rows: list[dict]) -> str:
    lines = [f"{'model':24} {'config':8} {'wall ms (min-max)':>26} {'load ms':>10} {'exec ms':>10} {'vs off':>9} tc"]
    for row in rows:
        for c, v in row.get("configs", {}).items():
            w, l, e = v["wall_ms"], v["load_ms"], v["execute_ms"]
            extra = row["extra_wall_vs_off_ms"].get(c)
            lines.append(f"{row['model']:24} {c:8} {w['median']:9.1f} ({w['min']:7.1f}-{w['max']:7.1f}) "
                         f"{l['median']:10.1f} {e['median']:10.2f} {'' if extra is None else f'{extra:+9.1f}':>9} "
                         f"{','.join(map(str, v['coop_dispatches']))}")
        w = row.get("driver_warmup", {})
        if w:
            lines.append(f"{'':24} driver warm-up (untimed; the driver's shader cache cold, then warm): "
                         + ", ".join(f"{c} {r['wall_ms']:.1f} ms" for c, r in w.items()))
        t = row.get("traced", {})
        if t:
            lines.append(f"{'':24} traced: measuring span cold {t['cold']['measure_ms']} ms, "
                         f"warm {t['warm']['measure_ms']} ms; cache after cold: "
                         + "; ".join(f"{f.get('signatures')} signatures, {f.get('alternative_picked')} picked an "
                                     f"alternative" for f in row.get("cache_after_cold", [])))
        for k in ("error", "skipped"):
            if k in row:
                lines.append(f"{'':24} {k}: {str(row[k])[:300]}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(run.RESULTS / "first_load.json"))
    ap.add_argument("--models", default=",".join(MODELS), help="run.py model rows (bf16)")
    ap.add_argument("--repeat", type=int, default=run.REPEAT)
    ap.add_argument("--device", default="vulkan", help="etmetal run --device")
    ap.add_argument("--timeout", type=float, default=120, help="seconds for one subprocess (or export)")
    ap.add_argument("--run-seconds", type=float, default=5,
                    help="seconds one run is expected to take (a run starts only with twice that left)")
    ap.add_argument("--deadline", type=float, default=420, help="seconds for the whole run: later steps are skipped")
    ap.add_argument("--smoke", action="store_true", help="a tiny Whisper-style encoder instead (lavapipe)")
    args = ap.parse_args()
    if args.smoke:
        args.models = "smoke"
    clock = Clock(args.deadline)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not run.binary().exists():
        sys.exit(f"no etmetal binary at {run.binary()}: set ETMETAL_BIN")
    machine = card()
    print(f"card: {machine['nvidia_smi']}; {machine['etmetal']}", flush=True)
    rows = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="first_load-") as d:
        for name in args.models.split(","):
            if clock.left() < 30:
                rows.append({"model": name, "skipped": ["the deadline"]})
                continue
            try:
                rows.append(measure_model(name, args, Path(d), clock, out.parent))
            except Exception as e:  # (the export or compile failed)
                rows.append({"model": name, "error": str(e)[-1500:]})
            out.write_text(json.dumps({"machine": machine, "repeat": args.repeat, "device": args.device,
                                       "notes": NOTES,
                                       "run": time.strftime("%Y-%m-%d", time.gmtime()), "rows": rows},
                                      indent=1) + "\n")
    print(table(rows))
    print(f"wrote {out} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
