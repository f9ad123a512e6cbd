"""etmetal-made `.pte` files run by ExecuTorch's own runtime.

Every zoo module (its dtypes, both export modes) is saved as `.pt2`,
compiled with `etmetal compile MODEL.pt2 -o MODEL.pte --backend cpu`, loaded
with `executorch.runtime` and compared with eager PyTorch at the zoo's
tolerances. A failure names the exported ops and etmetal's or ExecuTorch's
message (which names the node or kernel). Then the memory plan: etmetal's
arena must not be larger than ExecuTorch's own for three zoo models.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import torch
from executorch.exir import to_edge
from executorch.exir._serialize._program import deserialize_pte_binary
from executorch.runtime import Runtime

import zoo
from runner import RUN_TIMEOUT_S, to_npy
from test_parity import compare, prepared, save


@functools.cache
def runtime() -> Runtime:
    return Runtime.get()


def compile_pte(etmetal, ep: torch.export.ExportedProgram, work: Path, name: str) -> tuple[Path, subprocess.CompletedProcess]:
    pt2, pte = save(ep, work / f"{name}.pt2"), work / f"{name}.pte"
    cmd = [str(etmetal.binary), "compile", str(pt2), "-o", str(pte), "--backend", "cpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return pte, res


def arena_bytes(pte: bytes) -> list[int]:
    return list(deserialize_pte_binary(pte).program.execution_plan[0].non_const_buffer_sizes)


@pytest.mark.parametrize(
    "case,dtype,mode",
    [pytest.param(c, d, m, id=f"{c.name}-{d}-{m}") for c, d, m in zoo.params()],
)
def test_compiled_pte_runs_in_executorch(case, dtype, mode, etmetal, tmp_path):
    _, inputs, want, ep = prepared(case.name, dtype)
    if mode == "decomposed":
        ep = ep.run_decompositions()
    where = f"{case.name} [{dtype}, {mode}], ops: {', '.join(zoo.op_targets(ep))}"
    pte, res = compile_pte(etmetal, ep, tmp_path, case.name)
    assert res.returncode == 0, f"{where}\netmetal compile failed (exit {res.returncode}):\n{res.stderr}"
    try:
        method = runtime().load_program(pte).load_method("forward")
        got = method.execute(list(inputs))
    except Exception as e:  # ExecuTorch reports a missing kernel or bad argument here
        pytest.fail(f"{where}\nExecuTorch could not run the .pte: {e}")
    assert len(got) == len(want), f"{where}\n{len(got)} outputs, eager has {len(want)}"
    atol, rtol = case.tolerance(dtype)
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(got, want)) if (m := compare(to_npy(g), w, atol, rtol))]
    assert not problems, f"{where}\n" + "\n".join(problems)


ARENA_CASES = ("mlp_relu", "resnet_basic_block", "gpt2_block_causal_sdpa")


@pytest.mark.parametrize("name", ARENA_CASES)
def test_arena_not_larger_than_executorch(name, etmetal, tmp_path):
    _, inputs, _, ep = prepared(name, zoo.F32)
    pte, res = compile_pte(etmetal, ep, tmp_path, name)
    assert res.returncode == 0, res.stderr
    ours = arena_bytes(pte.read_bytes())
    theirs = arena_bytes(to_edge(ep).to_executorch().buffer)
    print(f"{name}: etmetal arena {ours}, ExecuTorch {theirs}")
    assert len(ours) == 2 and ours[0] == 0
    assert ours[1] <= sum(theirs), f"{name}: etmetal plans {ours[1]} bytes, ExecuTorch {theirs}"
