#!/usr/bin/env python3
"""The host path of a GPU delegate against PyTorch's copies of the same bytes.

For every size from 1 KiB to 1 GiB (powers of 4) in f32 and bf16: an
identity-like program (`x * 1`) compiled for the GPU, timed with
`etmetal run --bench` (one `Method::execute`: the input converted and
uploaded, one dispatch, the output read back and converted), beside
PyTorch's `x.cuda()` then `.cpu()` of a host tensor of the same bytes
(wall clock, both copies synchronous). The etmetal kernel time (timestamp
queries) is reported apart, so `etmetal host ms` = end to end minus kernel
is what the host path adds; issue #18's goal is host ms <= PyTorch's ms.

Writes results/host_path.json. Without CUDA (a machine with lavapipe) the
PyTorch side is skipped with a message and etmetal still runs; use
`--max-bytes` there to keep to small sizes.

    ETMETAL_BIN=.bench/etmetal python3 benchmarks/host_path.py [--max-bytes 1G]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def binary() -> Path:
    b = os.environ.get("ETMETAL_BIN")
    return Path(b) if b else ROOT.parent / ".bench" / "etmetal"


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("IB")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


class Identity(torch.nn.Module):
    def forward(self, x):
        return x * 1


def compile_identity(numel: int, dt: str, folder: Path) -> Path:
    """`x * 1` over `numel` elements, exported and compiled for the GPU."""
    x = torch.ones(numel, dtype=DTYPES[dt])
    ep = torch.export.export(Identity(), (x,))
    ep.example_inputs = None  # the .pt2 would otherwise carry the input's bytes
    pt2, pte = folder / f"id_{dt}_{numel}.pt2", folder / f"id_{dt}_{numel}.pte"
    torch.export.save(ep, str(pt2))
    # the whole tensor must fit one GPU binding, as in run.py's op step
    subprocess.run([binary(), "compile", pt2, "-o", pte, "--max-buffer", "2G"], check=True,
                   capture_output=True, text=True)
    pt2.unlink()
    return pte


def etmetal_bench(pte: Path, runs: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "bench.json"
        # no --inputs: all-ones inputs of the declared dtype, made once
        r = subprocess.run([binary(), "run", pte, "--output-dir", d, "--bench", str(runs),
                            "--warmup", str(warmup), "--bench-json", js],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"etmetal run {pte.name}: {r.stderr.strip()[-500:]}")
        return json.loads(js.read_text())


def torch_copies_ms(numel: int, dt: str, runs: int, warmup: int) -> float | None:
    """Median wall time of `x.cuda()` + `.cpu()` of a pageable host tensor."""
    if not torch.cuda.is_available():
        return None
    x = torch.ones(numel, dtype=DTYPES[dt])
    times = []
    for i in range(warmup + runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y = x.cuda().cpu()  # .cpu() waits for the device
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
        del y
    return statistics.median(times)


def machine() -> dict:
    info = {"cpu": platform.processor(), "cores": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-bytes", default="1G", help="largest tensor (1K .. 1G)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "host_path.json")
    ap.add_argument("--dtypes", default="f32,bf16")
    args = ap.parse_args()
    if not binary().exists():
        raise SystemExit(f"no etmetal binary at {binary()} (set ETMETAL_BIN)")
    if not torch.cuda.is_available():
        print("host_path: CUDA is not available: the PyTorch copies are skipped, etmetal runs alone",
              flush=True)
    sizes = [1 << b for b in range(10, 31, 2) if 1 << b <= parse_bytes(args.max_bytes)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for dt in args.dtypes.split(","):
            itemsize = torch.tensor([], dtype=DTYPES[dt]).element_size()
            for nbytes in sizes:
                numel = nbytes // itemsize
                # large copies take long: fewer runs keep the step short
                runs, warmup = (5, 2) if nbytes > 64 << 20 else (20, 5)
                pte = compile_identity(numel, dt, Path(d))
                b = etmetal_bench(pte, runs, warmup)
                pte.unlink()
                e2e = b["latency_ms"]["median"]
                gpu = (b.get("gpu") or {}).get("total_ms_median")
                torch_ms = torch_copies_ms(numel, dt, runs, warmup)
                host = e2e - gpu if gpu is not None else None
                row = {"dtype": dt, "bytes": nbytes, "runs": runs, "adapter": b.get("device"),
                       "etmetal_e2e_ms": e2e, "etmetal_kernel_ms": gpu, "etmetal_host_ms": host,
                       "torch_copies_ms": torch_ms,
                       "host_over_torch": host / torch_ms if host is not None and torch_ms else None}
                print(json.dumps(row), flush=True)
                rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    print(f"host_path: wrote {args.out}")


if __name__ == "__main__":
    main()
