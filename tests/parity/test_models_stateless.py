"""Whole stateless models (tests/parity/models/{cnn,encoders,audio}.py)
through the GPU path, against eager PyTorch: each is exported as users do
(`torch.export.export`), compiled with `etmetal compile --backend metal`
(auto partitioning) and run with `etmetal run --device auto`, in f32
(atol=rtol=1e-4) and bf16 (5e-2), as exported and after
`run_decompositions()` (core ATen, as ExecuTorch's `to_edge` gives). Random weights at CI sizes (the software
Vulkan driver runs ~1 GFLOP/s); `full` gives the issue's sizes.

    python tests/parity/test_models_stateless.py [--full]   # the delegation table
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from models.audio import AudioEncoder, whisper_tiny
from models.cnn import MobileNetV2, ResNet
from models.encoders import SentenceEncoder, bert_base, bert_inputs
from runner import default_binary
from test_parity import compare

TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def image(size: int):
    return lambda g: (torch.randn(1, 3, size, size, generator=g),)


def mel(frames: int):
    return lambda g: (torch.randn(1, 80, frames, generator=g),)


@dataclass(frozen=True)
class Model:
    name: str
    make: Callable[[], torch.nn.Module]  # CI size
    inputs: Callable[[torch.Generator], tuple]
    full: Callable[[], torch.nn.Module]  # the size
    full_inputs: Callable[[torch.Generator], tuple]


MODELS = [
    Model("resnet18", lambda: ResNet(width=0.25, classes=100), image(64), ResNet, image(224)),
    Model("mobilenet_v2", lambda: MobileNetV2(width=0.25, classes=100), image(64), MobileNetV2, image(224)),
    Model("bert", SentenceEncoder, bert_inputs, bert_base, lambda g: bert_inputs(g, vocab=30522)),
    Model("whisper_encoder", AudioEncoder, mel(300), whisper_tiny, mel(3000)),
]


def instantiate(model: Model, dtype: torch.dtype, full: bool = False):
    torch.manual_seed(0)
    module = (model.full if full else model.make)().eval().to(dtype)
    inputs = (model.full_inputs if full else model.inputs)(torch.Generator().manual_seed(1))
    return module, tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def export(module, inputs, mode: str) -> torch.export.ExportedProgram:
    ep = torch.export.export(module, inputs)
    return ep.run_decompositions() if mode == "decomposed" else ep


SUMMARY = re.compile(r"EtMetalBackend: (\d+) partition\(s\), (\d+) node\(s\), (\d+) kernel\(s\); (\d+) node\(s\) on the cpu")
CPU_NODE = re.compile(r"^  cpu: `[^`]*` \(([^)]*)\): (.*)$", re.M)


@pytest.mark.parametrize("mode", ["default", "decomposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_model_on_gpu(model, dtype, mode, etmetal_gpu, tmp_path):
    module, inputs = instantiate(model, dtype)
    with torch.no_grad():
        want = module(*inputs)
    pt2 = tmp_path / f"{model.name}.pt2"
    torch.export.save(export(module, inputs, mode), pt2)
    res = etmetal_gpu.run(pt2, inputs, tmp_path)
    assert res.returncode == 0, res.describe()
    summary = SUMMARY.search(res.stdout)
    assert summary and int(summary.group(1)) > 0, f"nothing delegated\n{res.describe()}"
    assert "ran on gpu" in res.stdout, f"delegates did not run on a GPU\n{res.describe()}"
    assert len(res.outputs) == 1, res.describe()
    problem = compare(res.outputs[0], want, TOL[dtype], TOL[dtype])
    assert problem is None, f"{model.name} {dtype}: {problem}\n{res.stdout}"


def delegation(binary: Path, pt2: Path) -> dict:
    """Compile `pt2` for the GPU; the partition summary, the node count after
    full decomposition (`inspect`; the backend keeps ops such as linear and
    batch norm whole, so its own count is delegated + cpu) and each op left
    on the cpu with its reason."""

    def call(*args):
        p = subprocess.run([str(binary), *args], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"etmetal {' '.join(args)}: {p.stderr}")
        return p.stdout

    compiled = call("compile", str(pt2), "-o", str(pt2.with_suffix(".pte")), "--backend", "metal")
    total = re.search(r"ops \((\d+) nodes", call("inspect", str(pt2)))
    parts, nodes, kernels, cpu = (int(x) for x in SUMMARY.search(compiled).groups())
    reasons: dict[str, int] = {}
    for op, why in CPU_NODE.findall(compiled):
        reasons[f"{op}: {why}"] = reasons.get(f"{op}: {why}", 0) + 1
    return dict(decomposed=int(total.group(1)), partitions=parts, delegated=nodes, kernels=kernels, cpu=cpu, reasons=reasons)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the issue's sizes (compile only)")
    ap.add_argument("--bin", type=Path, default=default_binary())
    args = ap.parse_args()
    print("| model | export | delegated nodes | partitions | kernels | on cpu (why) | nodes, fully decomposed |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            module, inputs = instantiate(model, torch.float32, args.full)
            for mode in ("default", "decomposed"):
                pt2 = Path(tmp) / f"{model.name}-{mode}.pt2"
                torch.export.save(export(module, inputs, mode), pt2)
                d = delegation(args.bin, pt2)
                why = "; ".join(f"{n}x {r}" for r, n in d["reasons"].items()) or "-"
                share = f"{d['delegated']}/{d['delegated'] + d['cpu']} ({100 * d['delegated'] / (d['delegated'] + d['cpu']):.0f}%)"
                print(f"| {model.name} | {mode} | {share} | {d['partitions']} | {d['kernels']} | {d['cpu']}: {why} | {d['decomposed']} |")


if __name__ == "__main__":
    main()
