"""Each form of an op row's kernels on the GPU machine, side by side: the
portable kernels (`--coop off`), every payload alternative forced in turn
(`ETMETAL_COOP_FORCE=N`) and the runtime's measured choice (`--coop
auto`), each with its kernel time, its ratio to PyTorch's kernel time on
the same inputs in the same run, and its error against PyTorch's result
on the same inputs (float64 on the GPU, or float32 where the op has no
float64 kernel). It answers which variant is fastest on this card and
whether every variant is right, before a variant becomes a default.

    python3 benchmarks/variants.py sdpa_10x20x1500:bf16 mm_4096:bf16 ... [--out FILE]

The `.pte` files come from `run.py prepare` (`.bench/ops/NAME.DTYPE.pte`);
the binary from `$ETMETAL_BIN` (default `.bench/etmetal`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (the harness: op cases, inputs, etmetal_bench)

MAX_ALTERNATIVES = 12


def forms(name: str, dt: str, runs: int) -> list[dict]:
    module, xs = run.make_op(name, dt, device="cuda", seed=1)
    with torch.no_grad():
        # PyTorch's kernel time in this run, the ratios' baseline (before
        # `.float()` turns the module's own weights to f32)
        torch_ms = run.torch_kernel_ms(lambda: module(*xs))
        want = module.float()(*(x.float() for x in xs))
    pte = run.WORK / "ops" / f"{name}.{dt}.pte"
    rows = [{"op": name, "dtype": dt, "form": "pytorch", "kernel_ms": torch_ms}]
    print(json.dumps(rows[-1]), flush=True)
    with tempfile.TemporaryDirectory() as d:
        inputs = run.write_inputs(xs, Path(d) / "in")
        tries = [("portable", "off", None), ("measured", "auto", None)]
        tries += [(f"alternative {k}", "auto", str(k)) for k in range(MAX_ALTERNATIVES)]
        seen = set()
        for label, coop, force in tries:
            env = dict(os.environ)
            env.pop("ETMETAL_COOP_FORCE", None)
            env["ETMETAL_TUNING_CACHE"] = "off"
            if force is not None:
                env["ETMETAL_COOP_FORCE"] = force
            try:
                b = run.etmetal_bench(pte, inputs, "auto", runs=runs, warmup=2, env=env, coop=coop)
            except Exception as e:  # a failing form is a row with its error
                rows.append({"op": name, "dtype": dt, "form": label, "error": str(e)[-300:]})
                continue
            gpu = b.get("gpu") or {}
            kernels = tuple(k["kernel"] for k in gpu.get("dispatches", []))
            if label == "portable":
                seen.add(kernels)
            elif force is not None and kernels in seen:
                break  # no alternative N: the portable kernels ran
            rows.append({"op": name, "dtype": dt, "form": label, "kernel_ms": gpu.get("total_ms_median"),
                         "e2e_ms": b["latency_ms"]["median"], "err": run.rel_err(b["output_0"], want),
                         "kernels": [(k["kernel"], round(k["median_ms"], 4)) for k in gpu.get("dispatches", [])]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="NAME:DTYPE, as run.py's op rows")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for case in a.cases:
        name, dt = case.split(":")
        rows += forms(name, dt, a.runs)
    print(f"{'op':<28} {'form':<16} {'kernel ms':>10} {'/ PyTorch':>9} {'err':>9}")
    torch_ms = {(r["op"], r["dtype"]): r["kernel_ms"] for r in rows if r["form"] == "pytorch"}
    for r in rows:
        what = f"{r['op'] + ' ' + r['dtype']:<28} {r['form']:<16}"
        if "error" in r:
            print(f"{what} error: {r['error'][-120:]}")
            continue
        ms = r["kernel_ms"] or 0
        ratio = ms / torch_ms[r["op"], r["dtype"]]
        err = f"{r['err']:>9.2e}" if "err" in r else ""
        print(f"{what} {ms:>10.4f} {ratio:>9.2f} {err}")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
