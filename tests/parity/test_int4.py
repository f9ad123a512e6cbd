"""int4 and MoE: the seed's int4 and MoE test modules (executorch's
backends/apple/metal/tests/test_modules.py) through etmetal, on CPU and GPU.

The seed builds its int4 references with torchao's MPS-only ops; here
`etmetal compile --quantize int4` quantizes, and the eager reference is the
dequantized model. To make that reference exact, each weight is first
snapped onto an int4 grid (every group holds codes 0 and 15 and is
`(q + m) * 2^-e`, exact in f32 and bf16): min-max quantization, which our
quantizer starts from, recovers such a weight exactly, so eager PyTorch on
the snapped float model *is* the dequantized model. The imported forms
(`torchao._linear_fp_act_4bit_weight`, `dequantize_affine` -> `linear`,
`metal::gather_qmv`, `metal::gated_delta_rule`) are compared with their
eager reference implementations. On the GPU path all of them run on the
GPU (the tests assert no node is left on the CPU).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zoo
from runner import to_npy
from test_parity import compare

import executorch.backends.apple.metal.ops.gated_delta_rule  # noqa: F401  registers metal::gated_delta_rule
from executorch.backends.apple.metal.ops.gather_qmv import _dequantize_int4_affine, _quantize_int4_affine

GS = 32
TOL = {"float32": (1e-4, 1e-4), "bfloat16": (1e-2, 1e-2)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = {"cpu": (["--backend", "cpu"], "cpu"), "gpu": (["--backend", "metal"], "auto")}


def snap_int4(module: nn.Module, gs: int, seed: int = 0) -> nn.Module:
    """Put every linear weight on an int4 grid (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.Linear):
            n, k = m.weight.shape
            q = torch.randint(0, 16, (n, k // gs, gs), generator=g)
            q[..., 0], q[..., 1] = 0, 15
            e = torch.randint(7, 10, (n, k // gs, 1), generator=g).float()
            m_off = torch.randint(-12, 4, (n, k // gs, 1), generator=g).float()
            w = (q.float() + m_off) * torch.exp2(-e)
            m.weight.data.copy_(w.reshape(n, k))
    return module


def run(etmetal, pt2, inputs, work, flags, device) -> tuple[list[np.ndarray], str]:
    """Compile `pt2` with `flags`, run it on `device`; outputs and stdout."""
    work.mkdir(parents=True, exist_ok=True)
    pte = work / "model.pte"
    cmd = [str(etmetal.binary), "compile", str(pt2), "-o", str(pte), *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"$ {' '.join(cmd)}\n{p.stderr}{p.stdout}"
    paths = []
    for i, t in enumerate(inputs):
        paths.append(str(work / f"input_{i}.npy"))
        np.save(paths[-1], to_npy(t))
    cmd = [str(etmetal.binary), "run", str(pte), "--output-dir", str(work / "out"), "--device", device]
    if paths:
        cmd += ["--inputs", ",".join(paths)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"$ {' '.join(cmd)}\n{r.stderr}{r.stdout}"
    outs = []
    while (work / "out" / f"output_{len(outs)}.npy").exists():
        outs.append(np.load(work / "out" / f"output_{len(outs)}.npy"))
    return outs, p.stderr + p.stdout + r.stdout


def check(module, inputs, dtype, device, tmp_path, flags=(), tol=None):
    module = module.to(DTYPES[dtype]).eval()
    inputs = tuple(t.to(DTYPES[dtype]) if t.is_floating_point() else t for t in inputs)
    with torch.no_grad():
        want = module(*inputs)
    want = list(want) if isinstance(want, tuple) else [want]
    ep = torch.export.export(module, inputs)
    pt2 = tmp_path / "model.pt2"
    torch.export.save(ep, pt2)
    extra, dev = DEVICES[device]
    got, log = run(_etmetal, pt2, inputs, tmp_path, [*extra, *flags], dev)
    assert len(got) >= len(want), log
    atol, rtol = tol or TOL[dtype]
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(got, want)) if (m := compare(g, w, atol, rtol))]
    assert not problems, "\n".join(problems) + "\n" + log
    return log


_etmetal = None


@pytest.fixture(autouse=True)
def _binary(etmetal):
    global _etmetal
    _etmetal = etmetal


# ---- the seed's int4 linear modules, quantized by `etmetal compile --quantize int4`
SEED_LINEARS = {
    "linear_nobias_int4": (128, 256, False, (127, 128)),
    "linear_bias_int4": (128, 256, True, (127, 128)),
    "linear_int4_qmv_impl": (640, 8198, True, (1, 640)),
    "linear_int4_qmv_impl_small_odd": (32, 3, True, (1, 32)),
    "linear_int4_qmv_impl_small_even": (32, 10, True, (1, 32)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SEED_LINEARS)
def test_seed_int4_linears(name, dtype, device, tmp_path):
    k, n, bias, shape = SEED_LINEARS[name]
    torch.manual_seed(0)
    m = snap_int4(nn.Sequential(nn.Linear(k, n, bias=bias)), GS)
    log = check(m, (torch.randn(shape),), dtype, device, tmp_path, ["--quantize", "int4", "--group-size", str(GS)])
    assert "1 linears in int4" in log, log
    if device == "gpu":  # the int4 kernel itself runs on the GPU, not a CPU fallback
        assert "; 0 node(s) on the cpu" in log and "ran on gpu" in log, log


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_quantized_llama_block_matches_the_dequantized_model(gs, dtype, device, tmp_path):
    torch.manual_seed(0)
    m = snap_int4(zoo.LlamaBlock("sdpa", d=128, heads=4, kv_heads=2, ffn=256), gs)
    tol = (2e-4, 2e-4) if dtype == "float32" else (3e-2, 3e-2)
    log = check(m, (torch.randn(2, 6, 128),), dtype, device, tmp_path, ["--quantize", "int4", "--group-size", str(gs)], tol)
    assert "7 linears in int4" in log, log
    if device == "gpu":
        assert "; 0 node(s) on the cpu" in log, log


# ---- the seed's MoE modules (their eager reference is the op's own Python)
class GatherQMV(nn.Module):
    def __init__(self):
        super().__init__()
        E, N, K = 4, 64, 128
        torch.manual_seed(0)
        packed, scales, biases = _quantize_int4_affine(torch.randn(E, N, K), GS)
        self.register_buffer("w", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("biases", biases)
        self.num_experts = E

    def forward(self, x):
        indices = torch.arange(x.shape[0], dtype=torch.int32) % self.num_experts
        return torch.ops.metal.gather_qmv(x, self.w, self.scales.to(x.dtype), self.biases.to(x.dtype), indices, GS)


class GatedDeltaRule(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(1, 4, 64, 64))

    def forward(self, q, k, v, g, beta):
        self.state.zero_()
        return torch.ops.metal.gated_delta_rule(q, k, v, g, beta, self.state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_seed_gather_qmv(dtype, device, tmp_path):
    # the seed's tolerances: the reference rounds the dequantized weight to x's dtype
    tol = (1e-4, 1e-4) if dtype == "float32" else (1e-1, 1e-1)
    log = check(GatherQMV(), (torch.randn(4, 128),), dtype, device, tmp_path, tol=tol)
    if device == "gpu":
        assert "; 0 node(s) on the cpu" in log, log


class GatedDeltaRuleGqa(nn.Module):
    """Two key heads for four value heads, Dk != Dv, a nonzero state in
    (a copy, so the eager reference run leaves the exported buffer as it was)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.randn(2, 4, 48, 32, generator=torch.Generator().manual_seed(3)) * 0.1)

    def forward(self, q, k, v, g, beta):
        state = self.state.clone()
        y = torch.ops.metal.gated_delta_rule(q, k, v, g, beta, state)
        return y, state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [False, True])
def test_seed_gated_delta_rule(gqa, dtype, device, tmp_path):
    g = torch.Generator().manual_seed(0)
    (b, t, hk, dk, hv, dv) = (2, 5, 2, 32, 4, 48) if gqa else (1, 2, 4, 64, 4, 64)
    inputs = (
        torch.randn(b, t, hk, dk, generator=g) * 0.3,
        F.normalize(torch.randn(b, t, hk, dk, generator=g), dim=-1),
        torch.randn(b, t, hv, dv, generator=g),
        torch.rand(b, t, hv, generator=g),
        torch.rand(b, t, hv, generator=g),
    )
    tol = (1e-4, 1e-4) if dtype == "float32" else (5e-2, 5e-2)
    log = check(GatedDeltaRuleGqa() if gqa else GatedDeltaRule(), inputs, dtype, device, tmp_path, tol=tol)
    if device == "gpu":
        assert "; 0 node(s) on the cpu" in log, log


# ---- int4 programs users bring
def _linear_4bit_reference(A, B, group_size, S, Z):
    w = _dequantize_int4_affine(B, S, Z, A.shape[-1], group_size)
    return (A.float() @ w.float().t()).to(A.dtype)


if not hasattr(torch.ops.torchao, "_linear_fp_act_4bit_weight"):
    # torchao registers it only with its macOS MPS library; the schema is its C++ one.
    torch.library.define("torchao::_linear_fp_act_4bit_weight", "(Tensor A, Tensor B, int group_size, Tensor S, Tensor Z) -> Tensor")
    torch.library.impl("torchao::_linear_fp_act_4bit_weight", "CompositeExplicitAutograd")(_linear_4bit_reference)
    torch.library.register_fake("torchao::_linear_fp_act_4bit_weight")(
        lambda A, B, group_size, S, Z: A.new_empty(A.shape[0], B.shape[0])
    )


class Fpa4wLinear(nn.Module):
    """What the seed's UIntxWeightOnlyQuantizedLinear exports: packed [N, K/2], scales and zeros [N, K/gs]."""

    def __init__(self, k=128, n=96):
        super().__init__()
        torch.manual_seed(1)
        packed, scales, zeros = _quantize_int4_affine(torch.randn(n, k), GS)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    def forward(self, x):
        return torch.ops.torchao._linear_fp_act_4bit_weight(x, self.packed, GS, self.scales.to(x.dtype), self.zeros.to(x.dtype))


class DequantizeAffineLinear(nn.Module):
    """IntxWeightOnlyConfig's export (`dequantize_affine` -> `linear`), with plain tensors."""

    def __init__(self, k=128, n=48):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.register_buffer("qdata", torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g))
        self.register_buffer("scale", torch.rand(n, k // GS, generator=g) * 0.05 + 0.01)
        self.register_buffer("zero_point", torch.randint(-2, 3, (n, k // GS), dtype=torch.int8, generator=g))
        self.bias = nn.Parameter(torch.randn(n, generator=g))

    def forward(self, x):
        import torchao.quantization.quant_primitives  # noqa: F401  registers torchao::dequantize_affine

        w = torch.ops.torchao.dequantize_affine(
            self.qdata, [1, GS], self.scale, self.zero_point, torch.int8, -8, 7, output_dtype=x.dtype
        )
        return F.linear(x, w, self.bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 20])
def test_imported_fpa4w_linear(batch, dtype, device, tmp_path):
    tol = (1e-4, 1e-4) if dtype == "float32" else (5e-2, 5e-2)
    check(Fpa4wLinear(), (torch.randn(batch, 128),), dtype, device, tmp_path, tol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_imported_dequantize_affine_linear_is_fused(dtype, device, tmp_path):
    tol = (1e-4, 1e-4) if dtype == "float32" else (5e-2, 5e-2)
    check(DequantizeAffineLinear(), (torch.randn(3, 128),), dtype, device, tmp_path, tol=tol)


def test_group_size_that_does_not_divide_k_is_named(etmetal, tmp_path):
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            packed, scales, zeros = _quantize_int4_affine(torch.randn(8, 96), 32)
            self.register_buffer("packed", packed)
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)

        def forward(self, x):
            return torch.ops.torchao._linear_fp_act_4bit_weight(x, self.packed, 64, self.scales, self.zeros)

    x = torch.randn(1, 96)
    ep = torch.export.export(Bad(), (x,), strict=False)
    torch.export.save(ep, tmp_path / "bad.pt2")
    p = subprocess.run(
        [str(etmetal.binary), "compile", str(tmp_path / "bad.pt2"), "-o", str(tmp_path / "bad.pte")],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert "_linear_fp_act_4bit_weight" in p.stderr and "does not divide K = 96" in p.stderr, p.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_torchao_intx_weight_only_export(device, tmp_path):
    """torchao's own IntxWeightOnlyConfig model: after `run_decompositions({})`
    its weight is plain qdata/scale/zero_point tensors into dequantize_affine."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 48), nn.ReLU(), nn.Linear(48, 64, bias=False)).eval()
    quantize_(m, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)), filter_fn=lambda mod, fqn: fqn == "0")
    x = torch.randn(5, 128)
    with torch.no_grad():
        want = m(x)
    ep = torch.export.export(m, (x,)).run_decompositions({})
    assert "torchao.dequantize_affine.default" in zoo.op_targets(ep)
    pt2 = tmp_path / "intx.pt2"
    torch.export.save(ep, pt2)
    extra, dev = DEVICES[device]
    got, log = run(_etmetal, pt2, (x,), tmp_path, extra, dev)
    problem = compare(got[0], want, 1e-4, 1e-4)
    assert problem is None, problem + "\n" + log
    shown = subprocess.run([str(_etmetal.binary), "inspect", str(pt2)], capture_output=True, text=True, timeout=120)
    assert "int4_linear" in shown.stdout, shown.stdout
