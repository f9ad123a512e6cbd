"""One model row compiled and run by several etmetal binaries in the same
run on the same card: a kernel change against the binary it replaces
(e.g. main's), kernel time and end to end, per kernel family, REPEAT
(3) separate `etmetal run --bench` sessions each. It answers whether a
change is faster on this card before it becomes a default.

    python3 benchmarks/binaries.py --bin main=.bench/etmetal-main --bin new=.bench/etmetal \\
        llama1b_user_decode512:int4 llama1b_user_decode512:bf16 llama1b_decode512:int4 \\
        [--flags int8='--quantize int8'] [--coop main=off] [--out FILE]

A row is `MODEL:DTYPE` of `run.py`'s model cases (its weights, inputs and
export; int4 rows are compiled with `--quantize int4 --group-size 32`);
`MODEL:DTYPE:NAME` compiles the DTYPE export with the flags `--flags
NAME=...` gives (e.g. an int8 row of the bf16 export). Each binary
compiles the row itself (`--max-buffer 2G`), so a change in compilation
counts too. Results: one JSON row per (row, binary) with the median and
[min, max] of the GPU and end-to-end figures, the dispatch count, the
file size, the compile's wall seconds, the error against the first
binary's output, the kernel families summed over the step and the host
trace of one execute (the first session's). Each binary runs with `--coop
auto` (tensor cores measured), or the mode `--coop NAME=MODE` gives it: the
same binary under two names compares tensor cores with portable kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (the harness: model cases, export, etmetal_bench)


def measure(exe: Path, pt2: Path, inputs: list[Path], flags: list[str], scratch: Path, coop: str) -> dict:
    pte = scratch / "row.pte"
    start = time.perf_counter()
    run.sh([exe, "compile", pt2, "-o", pte, "--max-buffer", "2G", *flags])
    compile_s = time.perf_counter() - start
    sessions = []
    try:
        for _ in range(run.REPEAT):
            os.environ["ETMETAL_BIN"] = str(exe)
            sessions.append(run.etmetal_bench(pte, inputs, "auto", coop=coop))
        size = pte.stat().st_size
    finally:
        pte.unlink(missing_ok=True)
    gpu = [s["gpu"]["total_ms_median"] for s in sessions]
    e2e = [s["latency_ms"]["median"] for s in sessions]
    families = collections.defaultdict(float)
    for k in sessions[0]["gpu"]["dispatches"]:
        families[k["kernel"]] += k["median_ms"]
    return {"gpu_ms": statistics.median(gpu), "gpu_ms_spread": [min(gpu), max(gpu)],
            "e2e_ms": statistics.median(e2e), "e2e_ms_spread": [min(e2e), max(e2e)],
            "dispatches": len(sessions[0]["gpu"]["dispatches"]), "size": size, "compile_s": round(compile_s, 2),
            "families": dict(sorted(families.items(), key=lambda x: -x[1])),
            "adapter": sessions[0]["device"], "host_trace": sessions[0]["trace"],
            "output": sessions[0]["output_0"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", help="MODEL:DTYPE or MODEL:DTYPE:FLAGS_NAME")
    ap.add_argument("--bin", action="append", required=True, help="NAME=PATH (the first is the reference)")
    ap.add_argument("--flags", action="append", default=[], help="NAME='compile flags'")
    ap.add_argument("--coop", action="append", default=[], help="BINARY_NAME=MODE (auto, all or off; default auto)")
    ap.add_argument("--out", default=str(run.RESULTS / "binaries.json"))
    args = ap.parse_args()
    bins = [b.split("=", 1) for b in args.bin]
    named = {k: shlex.split(v) for k, v in (f.split("=", 1) for f in args.flags)}
    coop = dict(c.split("=", 1) for c in args.coop)
    if unknown := set(coop) - {label for label, _ in bins}:
        ap.error(f"--coop names no --bin: {', '.join(sorted(unknown))}")
    machine = run.gpu_info()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        scratch = Path(d)
        for spec in args.rows:
            name, dt, *tag = spec.split(":")
            case = run.model_cases()[name]
            module, xs = run.make_model(name, dt)
            pt2 = scratch / "row.pt2"
            run.export_save(module, xs, pt2, case.recipe)
            del module
            inputs = run.write_inputs(xs, scratch / "in")
            flags = named[tag[0]] if tag else run.quant_flags(dt)
            ref = None
            for label, exe in bins:
                t = time.time()
                try:
                    row = measure(Path(exe), pt2, inputs, flags, scratch, coop.get(label, "auto"))
                    out = row.pop("output").astype(np.float64)
                    ref = out if ref is None else ref
                    row["err_vs_first"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                except Exception as e:  # a failing binary is a row with its error
                    row = {"error": str(e)[-600:]}
                rows.append({"row": spec, "binary": label, "flags": flags, "coop": coop.get(label, "auto"),
                             "seconds": round(time.time() - t, 1), **row})
                print(json.dumps(rows[-1]), flush=True)
            pt2.unlink()
    Path(args.out).write_text(json.dumps({"machine": machine, "run": time.strftime("%Y-%m-%d", time.gmtime()),
                                          "binaries": dict(bins), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
