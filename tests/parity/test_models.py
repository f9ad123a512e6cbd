"""Whole models (tests/parity/models/) against eager PyTorch. Stateful
decoders keep their KV cache in registered buffers: each is exported twice
from the same module, as ExecuTorch's multi-method programs are (`forward`:
one token; `prefill`: PROMPT tokens; either `run_decompositions({})`
functionalizes the in-place cache updates into buffer mutations, as
`to_edge` does, or the program is saved as exported, in-place ops and all,
and etmetal's importer functionalizes them), compiled into one `.pte` (`--method prefill=...`) with
`--backend cpu` and `--backend metal`, and run by `etmetal generate
--replay` through ONE loaded model: prefill in one call, then STEPS
decode steps on the cache prefill left, then `reset_state` and the same
again. Every step's logits must match eager (whose own buffers advance the
same way), and the repeat must give the first run's logits exactly."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from models.decoders import decoder
from runner import to_npy

PROMPT = 128
STEPS = 32
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def decoder_steps():
    """The prefill inputs (PROMPT tokens at positions 0..PROMPT) and STEPS
    single-token decode inputs after them."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (PROMPT + STEPS,), generator=g)
    prefill = (tokens[:PROMPT].view(1, PROMPT), torch.arange(PROMPT))
    decode = [(tokens[PROMPT + k].view(1, 1), torch.tensor([PROMPT + k])) for k in range(STEPS)]
    return prefill, decode


def compile_two_methods(etmetal, model, prefill, decode, tmp_path: Path, backend: str,
                        functional: bool = True):
    """`forward` (decode) and `prefill` of `model` in one `.pte`, and the
    compile report. `functional=False` saves the exports as they are."""
    files = {}
    for name, inputs in [("forward", decode[0]), ("prefill", prefill)]:
        ep = torch.export.export(copy.deepcopy(model), inputs)
        ep = ep.run_decompositions({}) if functional else ep
        files[name] = tmp_path / f"{name}.pt2"
        torch.export.save(ep, files[name])
    pte = tmp_path / "decoder.pte"
    p = subprocess.run([str(etmetal.binary), "compile", str(files["forward"]), "--method",
                        f"prefill={files['prefill']}", "-o", str(pte), "--backend", backend],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return pte, p.stdout


@pytest.mark.parametrize("backend", ["cpu", "metal"])
@pytest.mark.parametrize("dtype,export", [(torch.float32, "functional"), (torch.bfloat16, "functional"),
                                          (torch.float32, "as_exported")],
                         ids=["f32", "bf16", "f32-as-exported"])
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_decoder_prefill_then_decode_steps(kind, dtype, export, backend, etmetal, tmp_path):
    model = decoder(kind).to(dtype)
    prefill, decode = decoder_steps()
    pte, report = compile_two_methods(etmetal, model, prefill, decode, tmp_path, backend,
                                      functional=export == "functional")
    if backend == "metal":
        # the cache lives in one partition each: it stays on the GPU
        assert report.count("state kept on the GPU") == 2, report
    steps = [("prefill", prefill)] + [("forward", d) for d in decode]
    device = "auto" if backend == "metal" else "cpu"
    r = etmetal.replay(pte, steps, tmp_path, "--device", device, "--repeat", "2")
    assert r.returncode == 0, f"{report}\n{r.stderr}"
    tol = TOL[dtype]
    with torch.no_grad():
        for k, (method, inputs) in enumerate(steps):
            want = to_npy(model(*inputs))
            got = np.load(tmp_path / f"step{k}_output0.npy")
            assert got.shape == want.shape, f"step {k} ({method}): {got.shape} vs {want.shape}"
            err = np.abs(got.astype(np.float64) - want) - tol * np.abs(want)
            assert (err <= tol).all(), (
                f"{kind} {dtype} {backend}: step {k} ({method}) differs by up to "
                f"{np.abs(got - want).max():.3g}\n{report}")
            again = np.load(tmp_path / f"run1_step{k}_output0.npy")
            assert np.array_equal(again, got), f"step {k} ({method}) after reset_state differs"


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_decoder_cpu_pte_keeps_state_in_executorch(kind, etmetal, tmp_path):
    """etmetal's two-method `--backend cpu` file runs in ExecuTorch's own
    runtime. Its mutable buffers are laid out as `share_mutable_buffers=True`
    lays them out (planned memory 2, one offset per name in every method),
    and ExecuTorch's Python runtime gives host-only methods one set of
    arenas, so the cache prefill writes is the one decode reads. Both
    methods are loaded first: loading a method writes the initial state."""
    from executorch.runtime import Runtime

    model = decoder(kind)
    prefill, decode = decoder_steps()
    pte, _ = compile_two_methods(etmetal, model, prefill, decode[:6], tmp_path, "cpu")
    program = Runtime.get().load_program(pte.read_bytes())  # kept alive while the methods run
    methods = {name: program.load_method(name) for name in ["forward", "prefill"]}
    steps = [("prefill", prefill)] + [("forward", d) for d in decode[:6]]
    with torch.no_grad():
        for k, (name, step) in enumerate(steps):
            got, want = methods[name].execute(step)[0], model(*step)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (
                f"step {k} ({name}): {(got - want).abs().max()}")
