"""ExecuTorch-made `.pte` files run by etmetal's runtime.

For every zoo module ExecuTorch lowers the default export with its portable
operators (`to_edge(export(m)).to_executorch()`); the `etmetal` binary runs
the saved `.pte` and is compared with eager PyTorch at the zoo's tolerances.
An operator etmetal cannot run fails the case and is named in the message.
In f32 the same file, read and written again by etmetal-pte's writer (its
`roundtrip` example), must give exactly the same outputs in etmetal, and
must still load and run in ExecuTorch's own runtime (`executorch.runtime`),
matching eager PyTorch: the README's round-trip claim.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest
import torch
from executorch.exir import to_edge
from executorch.runtime import Runtime

import zoo
from runner import REPO, Runner, to_npy
from test_parity import compare


def roundtrip_binary() -> Path:
    """etmetal-pte's `roundtrip` example (`cargo build --release -p etmetal-pte --example roundtrip`)."""
    if os.environ.get("ETMETAL_PTE_ROUNDTRIP"):
        return Path(os.environ["ETMETAL_PTE_ROUNDTRIP"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return (target if target.is_absolute() else REPO / target) / "release" / "examples" / "roundtrip"


@functools.lru_cache(maxsize=2)
def prepared(name: str, dtype: str):
    """Inputs, eager outputs, ExecuTorch's program and its operator names."""
    module, inputs = zoo.instantiate(zoo.CASES_BY_NAME[name], dtype)
    want = zoo.eager_outputs(module, inputs)
    program = to_edge(torch.export.export(module, inputs)).to_executorch()
    ops = sorted({f"{o.name}.{o.overload}" for o in program.executorch_program.execution_plan[0].operators})
    return inputs, want, program.buffer, ops


@pytest.fixture(scope="module")
def pte_runner(etmetal) -> Runner:
    # The runner's .pt2 path runs the given file as it is: here a .pte.
    return Runner(etmetal.binary, "pt2")


@pytest.mark.parametrize(
    "case,dtype",
    [pytest.param(c, d, id=f"{c.name}-{d}") for c in zoo.CASES for d in c.dtypes],
)
def test_executorch_pte(case, dtype, pte_runner, tmp_path):
    inputs, want, buffer, ops = prepared(case.name, dtype)
    pte = tmp_path / f"{case.name}.pte"
    pte.write_bytes(buffer)
    where = f"{case.name} [{dtype}], ExecuTorch operators: {', '.join(ops)}"
    res = pte_runner.run(pte, inputs, tmp_path / "run")
    assert res.returncode == 0, f"{where}\netmetal failed:\n{res.describe()}"
    assert len(res.outputs) == len(want), f"{where}\n{len(res.outputs)} outputs, eager has {len(want)}"
    atol, rtol = case.tolerance(dtype)
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(res.outputs, want)) if (m := compare(g, w, atol, rtol))]
    assert not problems, f"{where}\n" + "\n".join(problems)

    if dtype != zoo.F32:
        return
    tool = roundtrip_binary()
    assert tool.is_file(), f"{tool} missing: cargo build --release -p etmetal-pte --example roundtrip (or set ETMETAL_PTE_ROUNDTRIP)"
    again = tmp_path / f"{case.name}.roundtrip.pte"
    p = subprocess.run([str(tool), str(pte), str(again)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{where}\nroundtrip failed:\n{p.stderr}"
    res2 = pte_runner.run(again, inputs, tmp_path / "run2")
    assert res2.returncode == 0, f"{where}\netmetal failed on the round-tripped file:\n{res2.describe()}"
    for i, (a, b) in enumerate(zip(res.outputs, res2.outputs)):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), f"{where}\noutput {i} changed after round trip"
    try:
        got = Runtime.get().load_program(again).load_method("forward").execute(list(inputs))
    except Exception as e:  # ExecuTorch names the field or kernel it could not take
        pytest.fail(f"{where}\nExecuTorch could not run the round-tripped file: {e}")
    assert len(got) == len(want), f"{where}\nExecuTorch: {len(got)} outputs after round trip, eager has {len(want)}"
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(got, want)) if (m := compare(to_npy(g), w, atol, rtol))]
    assert not problems, f"{where}\nExecuTorch's run of the round-tripped file:\n" + "\n".join(problems)
