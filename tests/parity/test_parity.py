"""Parity: every zoo module, exported (default and decomposed) and run by
etmetal, must match eager PyTorch on CPU. Plus two bad-input contracts."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

import zoo
from runner import to_npy

NPY_DTYPE = {torch.bfloat16: np.dtype(np.float32)}  # bf16 outputs come back as float32


@functools.lru_cache(maxsize=2)
def prepared(name: str, dtype: str):
    """Module, inputs, eager outputs and the default export, shared by both modes."""
    module, inputs = zoo.instantiate(zoo.CASES_BY_NAME[name], dtype)
    want = zoo.eager_outputs(module, inputs)
    return module, inputs, want, zoo.export(module, inputs, "default")


def save(ep: torch.export.ExportedProgram, path):
    torch.export.save(ep, path)
    return path


def compare(got: np.ndarray, want: torch.Tensor, atol: float, rtol: float) -> str | None:
    """None when `got` matches `want`, else what is wrong and where."""
    w = to_npy(want)
    want_dtype = NPY_DTYPE.get(want.dtype, w.dtype)
    if got.dtype != want_dtype or got.shape != w.shape:
        return f"got {got.dtype}{list(got.shape)}, want {want_dtype}{list(w.shape)}"
    if got.size == 0:
        return None
    if not np.issubdtype(w.dtype, np.floating):
        bad = got != w
        if not bad.any():
            return None
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        return f"{int(bad.sum())} of {w.size} elements differ; first at {pos}: got {got[pos]}, want {w[pos]}"
    g, w = got.astype(np.float64), w.astype(np.float64)
    same = (g == w) | (np.isnan(g) & np.isnan(w))  # equal infinities and NaNs match
    with np.errstate(invalid="ignore"):  # inf - inf; such positions are in `same`
        err = np.where(same, 0.0, np.abs(g - w))
    err = np.where(np.isnan(err), np.inf, err)
    bad = err > atol + rtol * np.abs(w)
    if not bad.any():
        return None
    pos = np.unravel_index(int(np.argmax(err)), err.shape)
    pos = tuple(int(i) for i in pos)
    return (
        f"max abs err {err[pos]:.3g} at {pos} (got {g[pos]:.8g}, want {w[pos]:.8g}); "
        f"{int(bad.sum())} of {w.size} elements outside atol={atol:g} rtol={rtol:g}"
    )


@pytest.mark.parametrize(
    "case,dtype,mode",
    [pytest.param(c, d, m, id=f"{c.name}-{d}-{m}") for c, d, m in zoo.params()],
)
def test_parity(case, dtype, mode, etmetal, tmp_path):
    _, inputs, want, ep = prepared(case.name, dtype)
    if mode == "decomposed":
        ep = ep.run_decompositions()
    ops = zoo.op_targets(ep)
    where = f"{case.name} [{dtype}, {mode}], ops: {', '.join(ops)}"
    res = etmetal.run(save(ep, tmp_path / f"{case.name}.pt2"), inputs, tmp_path)
    assert res.returncode == 0, f"{where}\netmetal failed:\n{res.describe()}"
    assert len(res.outputs) == len(want), f"{where}\n{len(res.outputs)} outputs, eager has {len(want)}\n{res.describe()}"
    atol, rtol = case.tolerance(dtype)
    problems = []
    for i, (g, w) in enumerate(zip(res.outputs, want)):
        msg = compare(g, w, atol, rtol)
        if msg:
            problems.append(f"output {i}: {msg}")
    assert not problems, f"{where}\n" + "\n".join(problems)


def test_compare_catches_errors():
    """The comparison itself: within tolerance passes, beyond it names the position."""
    want = torch.tensor([[1.0, 2.0], [3.0, float("-inf")]])
    ok = to_npy(want) + np.float32(5e-6)
    ok[1, 1] = -np.inf
    assert compare(ok, want, 1e-5, 1e-5) is None
    bad = ok.copy()
    bad[1, 0] = 3.01
    assert "at (1, 0)" in compare(bad, want, 1e-5, 1e-5)
    assert "want float32[2, 2]" in compare(ok[:1], want, 1e-5, 1e-5)
    assert "want float32" in compare(ok.astype(np.float64), want, 1e-5, 1e-5)
    assert compare(np.array([1, 2]), torch.tensor([1, 3]), 0, 0).startswith("1 of 2 elements differ")
    assert compare(to_npy(want.bfloat16()), want.bfloat16(), 1e-2, 1e-2) is None


def expect_bad_input(res, pattern: str):
    """Exit 2 with a message on stderr matching `pattern`, no panic."""
    assert res.returncode == 2, f"want exit 2\n{res.describe()}"
    msg = res.stderr.strip()
    assert msg, f"want a message on stderr\n{res.describe()}"
    assert "\n" not in msg, f"want a one-line message on stderr\n{res.describe()}"
    assert "panicked" not in msg, res.describe()
    assert re.search(pattern, msg, re.IGNORECASE), f"message does not match {pattern!r}\n{res.describe()}"


def test_wrong_input_shape_exits_2(etmetal, tmp_path):
    module = zoo.SingleLinear().eval()
    ep = zoo.export(module, (torch.randn(2, 8),), "default")
    res = etmetal.run(save(ep, tmp_path / "linear.pt2"), (torch.randn(3, 5),), tmp_path)
    expect_bad_input(res, r"features|input[ _#]*0")


def test_unsupported_op_exits_2(etmetal, tmp_path):
    class Bessel(torch.nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x) + 1

    x = torch.randn(3, 4)
    ep = zoo.export(Bessel(), (x,), "default")
    assert "aten.special_bessel_j0.default" in zoo.op_targets(ep)
    res = etmetal.run(save(ep, tmp_path / "bessel.pt2"), (x,), tmp_path)
    expect_bad_input(res, r"special_bessel_j0")


def test_write_through_an_uninvertible_view_exits_2(etmetal, tmp_path):
    """A buffer written through a `view` (which the importer cannot send the
    write back through) is refused naming the view and the remedy, never
    run with the buffer's old value."""

    class ViewWrite(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(2, 3))

        def forward(self, x):
            self.acc.view(6).add_(x)
            return self.acc * 2

    x = torch.randn(6)
    ep = torch.export.export(ViewWrite(), (x,))
    assert "aten.add_.Tensor" in zoo.op_targets(ep)
    res = etmetal.run(save(ep, tmp_path / "view_write.pt2"), (x,), tmp_path)
    expect_bad_input(res, r"`view`.*run_decompositions")
