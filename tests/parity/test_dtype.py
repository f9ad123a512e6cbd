"""`etmetal compile --dtype bf16` of a float32 export against eager
`module.to(torch.bfloat16)`: parameters, buffers and inputs in bf16, the
program's own explicit float32 casts (and what computes from them) in f32."""

from __future__ import annotations

import torch
from torch import nn

import zoo
from runner import Runner
from test_parity import compare, save


class Rotary(nn.Module):
    """transformers' rotary embedding (`inv_freq @ position_ids.float()`,
    cos/sin in f32, cast to the activations' dtype where they meet them)."""

    def __init__(self, dim: int = 16, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float()
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        y = self.proj(x)
        return cos, sin, y * cos.to(x.dtype) + y.flip(-1) * sin.to(x.dtype)


def test_bf16_rotary_positions_past_256_stay_float32(etmetal, tmp_path):
    torch.manual_seed(0)
    module = Rotary().eval()
    # Past 256 bf16 holds only even integers, past 512 multiples of 4.
    positions = torch.tensor([[0, 1, 255, 257, 301, 513, 777, 999]])
    x = torch.randn(1, positions.shape[1], 16)
    ep = zoo.export(module, (x, positions), "default")
    pte = tmp_path / "rotary.pte"
    p = etmetal._exec(["compile", str(save(ep, tmp_path / "rotary.pt2")), "-o", str(pte),
                       "--backend", "cpu", "--dtype", "bf16"])
    assert p.returncode == 0, p.stderr
    eager = module.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        want = eager(xb, positions)
    assert [w.dtype for w in want] == [torch.float32, torch.float32, torch.bfloat16]
    res = Runner(etmetal.binary, "pt2").run(pte, (xb, positions), tmp_path / "run")
    assert res.returncode == 0, res.describe()
    problems = [f"output {i}: {msg}" for i, (g, w) in enumerate(zip(res.outputs, want))
                if (msg := compare(g, w, 1e-2, 1e-2))]
    assert len(res.outputs) == 3 and not problems, "\n".join(problems)


def test_python_compile_dtype_matches_eager(tmp_path):
    """`etmetal.compile(ep, dtype=…)` is `etmetal compile --dtype` from
    Python: one float32 export, compiled for bf16 and f16 with the CPU and
    the Metal backend, against eager `module.to(dtype)`."""
    import copy

    import etmetal as etm

    torch.manual_seed(0)
    module = Rotary().eval()
    positions = torch.tensor([[0, 1, 255, 257, 301, 513, 777, 999]])
    x = torch.randn(1, positions.shape[1], 16)
    ep = zoo.export(module, (x, positions), "default")
    problems = []
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        eager = copy.deepcopy(module).to(torch_dtype)
        xd = x.to(torch_dtype)
        with torch.no_grad():
            want = eager(xd, positions)
        for backend in ("cpu", "metal"):
            pte = tmp_path / f"rotary_{dtype}_{backend}.pte"
            pte.write_bytes(etm.compile(ep, dtype=dtype, backend=backend))
            outputs = etm.load(pte).forward(xd, positions)
            assert len(outputs) == 3, (dtype, backend)
            problems += [f"{dtype} {backend} output {i}: {msg}" for i, (g, w) in enumerate(zip(outputs, want))
                         if (msg := compare(g, w, 1e-2, 1e-2))]
    assert not problems, "\n".join(problems)
