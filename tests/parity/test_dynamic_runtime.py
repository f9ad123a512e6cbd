"""ExecuTorch-made programs with bounded dynamic shapes, run by etmetal.

Each module of `dynamic_modules.py` (an MLP with a dynamic batch, an
attention block with a dynamic sequence, a conv net with a dynamic batch, a
view/slice/arange of a dynamic dim, a decoder block over a dynamic
number of tokens with a causal mask built at run time) is exported with its `Dim` range and
lowered by ExecuTorch (`to_edge(...).to_executorch()`, portable kernels): the
`.pte` plans its tensors at the upper bound (DYNAMIC_BOUND). The same file
runs in `etmetal run` at the smallest, an odd and the largest size of the
range and matches eager PyTorch; a size above the bound is refused naming
the input, the dim, the size and the bound.
"""

from __future__ import annotations

import functools

import pytest
import torch
from executorch.exir import to_edge
from torch.export import export

from dynamic_modules import MODULES
from runner import Runner
from test_parity import compare

ATOL = RTOL = 1e-5


@functools.lru_cache(maxsize=None)
def program(name: str):
    """The module and ExecuTorch's program bytes."""
    make = next(m for m in MODULES if m[0] == name)[1]
    torch.manual_seed(0)
    module, example, dynamic_shapes = make()
    module.eval()
    return module, to_edge(export(module, example, dynamic_shapes=dynamic_shapes)).to_executorch().buffer


@pytest.fixture(scope="module")
def pte_runner(etmetal) -> Runner:
    # The runner's .pt2 path runs the given file as it is: here a .pte.
    return Runner(etmetal.binary, "pt2")


@pytest.mark.parametrize(
    "name,size",
    [pytest.param(name, size, id=f"{name}-{size}") for name, _, _, sizes in MODULES for size in sizes],
)
def test_dynamic_sizes_match_eager(name, size, pte_runner, tmp_path):
    module, buffer = program(name)
    inputs_at = next(m for m in MODULES if m[0] == name)[2]
    torch.manual_seed(size)
    inputs = inputs_at(size)
    with torch.no_grad():
        want = module(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    pte = tmp_path / f"{name}.pte"
    pte.write_bytes(buffer)
    res = pte_runner.run(pte, inputs, tmp_path / "run")
    where = f"{name} at size {size}"
    assert res.returncode == 0, f"{where}\netmetal failed:\n{res.describe()}"
    assert "(dynamic), given" in res.stdout, f"{where}: run does not show the bounds\n{res.stdout}"
    assert len(res.outputs) == len(want), f"{where}: {len(res.outputs)} outputs, eager has {len(want)}"
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(res.outputs, want)) if (m := compare(g, w, ATOL, RTOL))]
    assert not problems, f"{where}\n" + "\n".join(problems)


def test_size_above_the_bound_is_refused(pte_runner, tmp_path):
    _, buffer = program("dyn_mlp")
    pte = tmp_path / "dyn_mlp.pte"
    pte.write_bytes(buffer)
    res = pte_runner.run(pte, (torch.randn(9, 4),), tmp_path / "run")
    assert res.returncode == 2, res.describe()
    assert "method `forward`: input 0: dim 0 is 9, above its upper bound 8" in res.stderr, res.describe()


def test_python_package_reports_the_bounds_and_runs_below_them(tmp_path):
    """`etmetal.load` shows which input dims are dynamic and up to what
    size, and runs the program at a smaller size."""
    import etmetal as etm

    module, buffer = program("dyn_mlp")
    pte = tmp_path / "dyn_mlp.pte"
    pte.write_bytes(buffer)
    method = etm.load(pte, device="cpu").method("forward")
    assert method.input_specs() == [("float32", [8, 4])]
    # ExecuTorch bounds a whole tensor, so every dim of the input is dynamic
    assert method.dynamic_inputs() == [[True, True]]
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = module(x)
    (got,) = method.execute(x)
    assert got.shape == tuple(want.shape), got.shape
    assert not compare(got, want, ATOL, RTOL)
