"""The GPU path: every zoo module (its dtypes, both export modes) compiled
with `etmetal compile --backend metal` (auto partitioning: GPU partitions,
CPU kernels for the rest) and run with `etmetal run --device auto` on this
machine's adapter (in CI: Mesa's software Vulkan), compared with eager
PyTorch at the zoo's tolerances.

Every module states its expected delegation (`Case.on_cpu`: empty for a
module the GPU takes whole, else the ops kept on the CPU and why), and the
test asserts exactly that, plus that a GPU adapter ran the delegates: a
partitioner regression cannot turn a GPU case into a silent CPU run.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

import zoo
from test_parity import compare, prepared, save

SUMMARY = re.compile(r"EtMetalBackend: (\d+) partition\(s\), (\d+) node\(s\), (\d+) kernel\(s\); (\d+) node\(s\) on the cpu")
CPU_NODE = re.compile(r"^  cpu: `([^`]+)` \(([^)]+)\): (.*)$", re.M)


def delegation(stdout: str) -> tuple[int, int, Counter]:
    """(partitions, delegated nodes, Counter of ops left on the CPU) from `compile`'s summary."""
    m = SUMMARY.search(stdout)
    assert m, f"no partition summary in\n{stdout}"
    cpu = Counter(op for _, op, _ in CPU_NODE.findall(stdout))
    assert sum(cpu.values()) == int(m.group(4)), f"cpu node lines disagree with the summary\n{stdout}"
    return int(m.group(1)), int(m.group(2)), cpu


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
    partitions, nodes, cpu = delegation(res.stdout)
    assert partitions >= 1 and nodes >= 1, f"{where}\nnothing delegated\n{res.stdout}"
    assert set(cpu) == set(case.on_cpu), (
        f"{where}\nexpected on the cpu: {sorted(case.on_cpu) or 'nothing'}; got {dict(cpu) or 'nothing'}\n{res.stdout}"
    )
    assert "ran on gpu" in res.stdout, f"{where}\ndelegates did not run on a GPU\n{res.describe()}"
    assert len(res.outputs) == len(want), f"{where}\n{len(res.outputs)} outputs, eager has {len(want)}\n{res.describe()}"
    atol, rtol = case.tolerance(dtype)
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(res.outputs, want)) if (m := compare(g, w, atol, rtol))]
    assert not problems, f"{where}\n" + "\n".join(problems) + f"\n{res.stdout}"
