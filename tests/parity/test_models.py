"""Whole models (tests/parity/models/) against eager PyTorch. Stateful
decoders keep their KV cache in registered buffers: each is exported
(`run_decompositions({})` functionalizes the in-place cache updates into
buffer mutations, as `to_edge` does), compiled with `--backend cpu` and
`--backend metal`, and run for 32 single-token steps through ONE loaded
method by the `generate` example's `--replay` mode; every step's logits
must match eager (whose own buffers advance the same way)."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from models.decoders import decoder
from runner import to_npy

STEPS = 32
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def generate_binary(etmetal_binary: Path) -> Path:
    path = Path(os.environ.get("ETMETAL_GENERATE") or etmetal_binary.parent / "examples" / "generate")
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"generate example not found at {path}; build it with "
                    "`cargo build --release -p etmetal --example generate` or set ETMETAL_GENERATE")
    return path


@pytest.mark.parametrize("backend", ["cpu", "metal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_decoder_kv_cache_steps(kind, dtype, backend, etmetal, tmp_path):
    model = decoder(kind).to(dtype)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (STEPS,), generator=g)
    step_inputs = [(tokens[k].view(1, 1), torch.tensor([k])) for k in range(STEPS)]
    ep = torch.export.export(copy.deepcopy(model), step_inputs[0]).run_decompositions({})
    pt2, pte = tmp_path / f"{kind}.pt2", tmp_path / f"{kind}.pte"
    torch.export.save(ep, pt2)
    p = subprocess.run([str(etmetal.binary), "compile", str(pt2), "-o", str(pte), "--backend", backend],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    for k, inputs in enumerate(step_inputs):
        for i, t in enumerate(inputs):
            np.save(tmp_path / f"step{k}_input{i}.npy", to_npy(t))
    device = "auto" if backend == "metal" else "cpu"
    r = subprocess.run([str(generate_binary(etmetal.binary)), str(pte), "--device", device,
                        "--replay", str(tmp_path), "--steps", str(STEPS)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{p.stdout}\n{r.stderr}"
    tol = TOL[dtype]
    with torch.no_grad():
        for k, inputs in enumerate(step_inputs):
            want = to_npy(model(*inputs))
            got = np.load(tmp_path / f"step{k}_output0.npy")
            assert got.shape == want.shape, f"step {k}: {got.shape} vs {want.shape}"
            err = np.abs(got.astype(np.float64) - want) - tol * np.abs(want)
            assert (err <= tol).all(), (
                f"{kind} {dtype} {backend}: step {k} differs by up to {np.abs(got - want).max():.3g}\n{p.stdout}")


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_decoder_cpu_pte_keeps_state_in_executorch(kind, etmetal, tmp_path):
    """etmetal's `--backend cpu` file with buffer mutations runs in
    ExecuTorch's own runtime, whose planned memory carries the cache."""
    from executorch.runtime import Runtime

    model = decoder(kind)
    inputs = [(torch.tensor([[t]]), torch.tensor([k])) for k, t in enumerate([5, 9, 2, 7, 11, 3])]
    ep = torch.export.export(copy.deepcopy(model), inputs[0]).run_decompositions({})
    pt2, pte = tmp_path / f"{kind}.pt2", tmp_path / f"{kind}.pte"
    torch.export.save(ep, pt2)
    p = subprocess.run([str(etmetal.binary), "compile", str(pt2), "-o", str(pte), "--backend", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    program = Runtime.get().load_program(pte.read_bytes())  # kept alive while the method runs
    method = program.load_method("forward")
    with torch.no_grad():
        for k, step in enumerate(inputs):
            got, want = method.execute(step)[0], model(*step)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"step {k}: {(got - want).abs().max()}"
