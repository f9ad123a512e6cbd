"""The GPU path: every zoo module (its dtypes, both export modes) compiled
with `etmetal compile --backend metal` (auto partitioning: GPU partitions,
CPU kernels for the rest) and run with `etmetal run --device auto` on this
machine's adapter (in CI: Mesa's software Vulkan), compared with eager
PyTorch at the zoo's tolerances. The test fails when no GPU ran a delegate
of a module the backend takes (a silent all-CPU run would prove nothing),
and when a module the GPU takes whole leaves a node on the CPU.
"""

from __future__ import annotations

import re

import pytest

import zoo
from test_parity import compare, prepared, save

# Modules with int64 arithmetic, comparisons and casts: the GPU computes
# int64 as checked i32, so no node of theirs stays on the CPU.
WHOLE_ON_GPU = {"int64_arithmetic", "arange_full_zeros_ones", "cumsum_float_int", "dtype_casts"}


@pytest.mark.parametrize(
    "case,dtype,mode",
    [pytest.param(c, d, m, id=f"{c.name}-{d}-{m}") for c, d, m in zoo.params()],
)
def test_gpu_parity(case, dtype, mode, etmetal_gpu, tmp_path):
    _, inputs, want, ep = prepared(case.name, dtype)
    if mode == "decomposed":
        ep = ep.run_decompositions()
    where = f"{case.name} [{dtype}, {mode}], ops: {', '.join(zoo.op_targets(ep))}"
    res = etmetal_gpu.run(save(ep, tmp_path / f"{case.name}.pt2"), inputs, tmp_path)
    assert res.returncode == 0, f"{where}\netmetal failed:\n{res.describe()}"
    delegated = re.search(r"EtMetalBackend: (\d+) partition\(s\), (\d+) node\(s\)", res.stdout)
    assert delegated, f"{where}\nno partition summary\n{res.describe()}"
    if int(delegated.group(1)) > 0:
        assert "ran on gpu" in res.stdout, f"{where}\ndelegates did not run on a GPU\n{res.describe()}"
    if case.name in WHOLE_ON_GPU:
        assert "; 0 node(s) on the cpu" in res.stdout, f"{where}\nnodes left on the cpu\n{res.stdout}"
    assert len(res.outputs) == len(want), f"{where}\n{len(res.outputs)} outputs, eager has {len(want)}\n{res.describe()}"
    atol, rtol = case.tolerance(dtype)
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(res.outputs, want)) if (m := compare(g, w, atol, rtol))]
    assert not problems, f"{where}\n" + "\n".join(problems) + f"\n{res.stdout}"
