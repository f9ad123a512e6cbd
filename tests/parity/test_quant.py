"""int8 and mixed weight-only quantization, and torchao's int8 weight-only
exports, through etmetal on the CPU and the GPU, against eager PyTorch.

As in test_int4.py, `etmetal compile --quantize int8` is checked against
an exact reference: each weight is first snapped onto an int8 grid (every
group holds codes 0 and 255 and is `(q + m) * 2^-e`, exact in f32), which
min-max quantization recovers exactly, so eager PyTorch on the snapped
float model *is* the dequantized model. `--quantize mixed` is checked for
its choice (a weight with outliers goes to int8, measured) and against the
float model within quantization's error. The imported forms (torchao's
`IntxWeightOnlyConfig` with int8 weights per channel, its int4/int8
embedding, and `Int8WeightOnlyConfig`) are compared with torchao's own
eager model. Calibration (`--calibrate`) and its bad inputs are tested on
the command line (crates/etmetal/tests/quantize.rs); its accuracy on Gemma
3 270M is scripts/eval_llm.py's (BENCHMARKS.md).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
import torch.nn as nn

import zoo
from test_int4 import DEVICES, run
from test_parity import compare


def snap_int8(module: nn.Module, gs: int | None, seed: int = 0) -> nn.Module:
    """Put every linear weight on an int8 grid, per group of `gs` (all of K
    where None)."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.Linear):
            n, k = m.weight.shape
            gk = gs or k
            q = torch.randint(0, 256, (n, k // gk, gk), generator=g)
            q[..., 0], q[..., 1] = 0, 255
            e = torch.randint(10, 13, (n, k // gk, 1), generator=g).float()
            m_off = torch.randint(-140, -115, (n, k // gk, 1), generator=g).float()
            m.weight.data.copy_(((q.float() + m_off) * torch.exp2(-e)).reshape(n, k))
    return module


def export(module: nn.Module, inputs, tmp_path, decompose=False):
    tmp_path.mkdir(parents=True, exist_ok=True)
    ep = torch.export.export(module, inputs)
    if decompose:
        ep = ep.run_decompositions({})
    pt2 = tmp_path / "model.pt2"
    torch.export.save(ep, pt2)
    return ep, pt2


def check(etmetal, module, inputs, device, tmp_path, flags=(), tol=(1e-4, 1e-4), decompose=False):
    """Compile and run `module` (eval, float32) with `flags` on `device`;
    compare with eager. The compile and run log."""
    module = module.eval()
    with torch.no_grad():
        want = module(*inputs)
    _, pt2 = export(module, inputs, tmp_path, decompose)
    extra, dev = DEVICES[device]
    got, log = run(etmetal, pt2, inputs, tmp_path, [*extra, *flags], dev)
    problem = compare(got[0], want, *tol)
    assert problem is None, problem + "\n" + log
    if device == "gpu":  # the quantized kernels run on the GPU, not a CPU fallback
        assert "; 0 node(s) on the cpu" in log and "ran on gpu" in log, log
    return log


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gs", [None, 32])
def test_int8_linears_match_the_dequantized_model(gs, device, etmetal, tmp_path):
    """int8 per output channel (the default) and per group of 32: prefill
    (5 rows) and a decode-shaped row."""
    torch.manual_seed(0)
    m = snap_int8(nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 64, bias=False)), gs)
    flags = ["--quantize", "int8"] + (["--group-size", str(gs)] if gs else [])
    for rows in (5, 1):
        log = check(etmetal, m, (torch.randn(rows, 96),), device, tmp_path / f"r{rows}", flags)
        assert "2 linears (" in log or "2 linears in int8" in log, log
        assert "in int8 (group " in log, log


@pytest.mark.parametrize("device", DEVICES)
def test_int8_llama_block(device, etmetal, tmp_path):
    """A Llama block (q/k/v and gate/up merged into one product each) in
    int8 per channel."""
    torch.manual_seed(0)
    m = snap_int8(zoo.LlamaBlock("sdpa", d=128, heads=4, kv_heads=2, ffn=256), None)
    log = check(etmetal, m, (torch.randn(2, 6, 128),), device, tmp_path, ["--quantize", "int8"], (2e-4, 2e-4))
    assert "7 linears (" in log or "7 linears in int8" in log, log


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_puts_the_measured_most_sensitive_weight_in_int8(device, etmetal, tmp_path):
    """`--quantize mixed`: the weight with outliers (the largest int4 error)
    is measured the most sensitive and goes to int8 (mixed.rs: int8 takes
    the most sensitive weights up to 70% of the elements, here two of three
    same-sized weights), and the output stays within quantization's error
    of the float model, below all-int4's."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).eval()
    with torch.no_grad():
        w = m[2].weight
        w[torch.rand(w.shape) < 0.02] *= 40
    x = torch.randn(3, 256)
    with torch.no_grad():
        want = m(x)
    _, pt2 = export(m, (x,), tmp_path)
    extra, dev = DEVICES[device]
    err, log = {}, ""
    for scheme in ("int4", "mixed"):
        got, log = run(etmetal, pt2, (x,), tmp_path / scheme, [*extra, "--quantize", scheme], dev)
        err[scheme] = float(np.linalg.norm(got[0] - want.numpy()) / np.linalg.norm(want.numpy()))
    # int4 of these random weights: 12% of the output; mixed: about half of that
    assert err["mixed"] < 0.1 and err["mixed"] < 0.7 * err["int4"], f"relative errors {err}\n{log}"
    line = next(l for l in log.splitlines() if "mixed:" in l)
    assert "2 of 3 weights in int8" in line and line.split(": ")[-1].startswith("2.weight, "), log
    assert "(1 in int4 (group 32), " in log, log


# ---- torchao's int8 weight-only exports
def intx(weight_dtype, granularity, embedding=False):
    from torchao.quantization import IntxWeightOnlyConfig

    cfg = IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=granularity)
    return cfg, (lambda mod, fqn: isinstance(mod, nn.Embedding)) if embedding else None


class EmbedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.fc1 = nn.Linear(64, 96)
        self.fc2 = nn.Linear(96, 32, bias=False)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["intx_int8_per_channel", "intx_int8_embedding", "intx_int4_embedding",
                                  "int8_weight_only"])
def test_torchao_int8_weight_only_export(form, device, etmetal, tmp_path):
    """torchao's weight-only forms as users export them (`run_decompositions({})`):
    `IntxWeightOnlyConfig` int8 per channel on the linears (dequantize_affine ->
    linear), int8 / int4 on the embedding (ExecuTorch's LLM export quantizes
    embeddings so: dequantize_affine -> embedding), and `Int8WeightOnlyConfig`
    (`mm(x, t(qdata).to(float)) * scale`): each weight becomes a quantized
    linear or a gather of packed rows, never a float weight."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    torch.manual_seed(0)
    m = EmbedMLP().eval()
    cfg, filt = {
        "intx_int8_per_channel": intx(torch.int8, PerAxis(0)),
        "intx_int8_embedding": intx(torch.int8, PerAxis(0), embedding=True),
        "intx_int4_embedding": intx(torch.int4, PerGroup(32), embedding=True),
        "int8_weight_only": (Int8WeightOnlyConfig(), None),
    }[form]
    quantize_(m, cfg, filter_fn=filt)
    ids = torch.tensor([[3, 7, 99, 0, 42]])
    with torch.no_grad():
        want = m(ids)
    ep, pt2 = export(m, (ids,), tmp_path, decompose=True)
    extra, dev = DEVICES[device]
    got, log = run(etmetal, pt2, (ids,), tmp_path, extra, dev)
    problem = compare(got[0], want, 1e-4, 1e-4)
    assert problem is None, problem + "\n" + log
    shown = subprocess.run([str(etmetal.binary), "inspect", str(pt2)], capture_output=True, text=True, timeout=120)
    if "embedding" in form:
        # the table's rows are gathered packed: no float table, no dequantize
        assert "dequantize" not in shown.stdout, shown.stdout
    else:
        assert "int8_linear" in shown.stdout, shown.stdout
