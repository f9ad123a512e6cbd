"""The Python plug-in (`python/`, importable as `etmetal`): EtMetalPartitioner
and EtMetalBackend inside ExecuTorch's `to_edge_transform_and_lower`, and
`etmetal.load`. Mirrors the tests of ExecuTorch's own Metal backend
(partitioning, ops_to_not_decompose, compile specs), then lowers every zoo
module through ExecuTorch and runs the `.pte` with `etmetal.load` and with
`etmetal run` on this machine's GPU adapter, against eager PyTorch.

`scripts/test.sh` builds the package into the venv (maturin); without it
this file fails at import, it never skips.
"""

from __future__ import annotations

import operator
import re
import subprocess

import numpy as np
import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.backend.compile_spec_schema import CompileSpec
from torch.export import export

import etmetal as etm  # the fixture `etmetal` is the CLI runner
import zoo
from etmetal import EtMetalBackend, EtMetalPartitioner
from etmetal._aot import _pt2_bytes
from runner import to_npy
from test_parity import compare

FORWARD = [EtMetalBackend.generate_method_name_compile_spec("forward")]


def partition_result(module: torch.nn.Module, inputs: tuple):
    ep = export(module, inputs, strict=True)
    result = EtMetalPartitioner(FORWARD).partition(ep)
    assert hasattr(result, "tagged_exported_program") and hasattr(result, "partition_tags")
    return result


def call_tags(result) -> list:
    """The delegation tag of every call_function node (None: untagged)."""
    return [n.meta.get("delegation_tag") for n in result.tagged_exported_program.graph.nodes if n.op == "call_function"]


class Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def test_simple_add_is_one_partition():
    result = partition_result(Add(), (torch.randn(2, 3), torch.randn(2, 3)))
    tags = call_tags(result)
    assert tags and None not in tags and len(set(tags)) == 1, tags
    assert list(result.partition_tags) == [tags[0]]
    assert result.partition_tags[tags[0]].backend_id == "EtMetalBackend"


def test_linear_is_fully_partitioned_with_its_weights():
    result = partition_result(torch.nn.Linear(10, 5), (torch.randn(2, 10),))
    tags = call_tags(result)
    assert tags and None not in tags and len(set(tags)) == 1, tags
    ep = result.tagged_exported_program
    params = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.inputs_to_parameters]
    assert len(params) == 2 and all(n.meta.get("delegation_tag") == tags[0] for n in params)


class ReluAddOne(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.relu(x + 1.0)


def test_ops_to_not_decompose_is_every_op_the_backend_takes():
    ep = export(ReluAddOne(), (torch.randn(2, 3),), strict=True)
    ops, check = EtMetalPartitioner(FORWARD).ops_to_not_decompose(ep)
    assert isinstance(ops, list) and check is None
    calls = {n.target for n in ep.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    assert set(ops) == calls


def test_ops_to_not_decompose_leaves_out_what_the_gpu_refuses():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ConvTranspose1d(2, 2, 3))
    ep = export(Reshaped(m), (torch.randn(2, 8),), strict=True)
    ops, _ = EtMetalPartitioner(FORWARD).ops_to_not_decompose(ep)
    names = {str(o) for o in ops}
    assert "aten.linear.default" in names
    assert not any("conv" in n for n in names), names


def test_method_name_compile_spec():
    spec = EtMetalBackend.generate_method_name_compile_spec("forward")
    assert isinstance(spec, CompileSpec)
    assert spec.key == "method_name" and spec.value == b"forward"
    assert EtMetalBackend.method_name_from_compile_specs([spec]) == "forward"


def test_method_name_round_trips_and_is_found_among_others():
    spec = EtMetalBackend.generate_method_name_compile_spec("my_custom_method")
    assert EtMetalBackend.method_name_from_compile_specs([spec]) == "my_custom_method"
    specs = [CompileSpec("other_key", b"other_value"), spec, CompileSpec("another_key", b"\xff\x00")]
    assert EtMetalBackend.method_name_from_compile_specs(specs) == "my_custom_method"


def test_missing_method_name_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="Could not find method name"):
        EtMetalBackend.method_name_from_compile_specs([CompileSpec("other_key", b"other_value")])


def test_skip_op_and_whole_mode_compile_specs():
    x = (torch.randn(2, 3), torch.randn(2, 3))
    ep = export(Add(), x, strict=True)
    skip = EtMetalPartitioner(FORWARD + [EtMetalBackend.generate_skip_op_compile_spec("add")])
    result = skip.partition(ep)
    assert call_tags(result) == [None] and result.partition_tags == {}
    whole = EtMetalPartitioner(FORWARD + [EtMetalBackend.generate_partition_compile_spec("whole"), EtMetalBackend.generate_skip_op_compile_spec("add")])
    with pytest.raises(RuntimeError, match="add"):
        whole.partition(export(Add(), x, strict=True))


# ------------------------------------------------ the zoo through ExecuTorch


class RecordingPartitioner(EtMetalPartitioner):
    """EtMetalPartitioner that keeps the program it was given (as the `.pt2`
    the CLI would read) and what it tagged, to compare with `etmetal compile`."""

    def partition(self, exported_program):
        self.pt2 = _pt2_bytes(exported_program)  # before tagging: the graph ExecuTorch hands over
        result = super().partition(exported_program)
        # read now: lowering replaces the tagged nodes by delegate calls afterwards
        self.tags, self.untagged = set(result.partition_tags), untagged_calls(result)
        return result


def lower(module: torch.nn.Module, inputs: tuple, partitioner=None):
    ep = export(module, inputs)
    partitioner = partitioner or EtMetalPartitioner(FORWARD)
    return to_edge_transform_and_lower(ep, partitioner=[partitioner]).to_executorch()


def plan_summary(et) -> tuple[int, list[str]]:
    """(EtMetalBackend delegates, portable operator names) of the lowered program."""
    plan = et.executorch_program.execution_plan[0]
    delegates = [d.id for d in plan.delegates]
    assert set(delegates) <= {"EtMetalBackend"}, delegates
    return len(delegates), [op.name for op in plan.operators]


@pytest.fixture(scope="module")
def add_pte(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "add.pte"
    path.write_bytes(lower(Add(), (torch.randn(2, 3), torch.randn(2, 3))).buffer)
    return path


def cli_run(binary, pte, inputs, work) -> tuple[subprocess.CompletedProcess, list[np.ndarray]]:
    paths = []
    for i, t in enumerate(inputs):
        paths.append(str(work / f"input_{i}.npy"))
        np.save(paths[-1], to_npy(t))
    out = work / "out"
    cmd = [str(binary), "run", str(pte), "--device", "auto", "--output-dir", str(out)]
    if paths:
        cmd += ["--inputs", ",".join(paths)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    outputs = []
    while p.returncode == 0 and (out / f"output_{len(outputs)}.npy").exists():
        outputs.append(np.load(out / f"output_{len(outputs)}.npy"))
    return p, outputs


def cli_partitions(binary, pt2_bytes: bytes, work) -> tuple[int, set[str]]:
    """(partitions, names of the nodes left on the CPU) of `etmetal compile
    --backend metal` on the program saved in `pt2_bytes`."""
    pt2 = work / "cli.pt2"
    pt2.write_bytes(pt2_bytes)
    p = subprocess.run([str(binary), "compile", str(pt2), "-o", str(work / "cli.pte")], capture_output=True, text=True, timeout=300)
    m = re.search(r"EtMetalBackend: (\d+) partition\(s\)", p.stdout)
    assert p.returncode == 0 and m, f"etmetal compile failed:\n{p.stderr}{p.stdout}"
    return int(m.group(1)), set(re.findall(r"^  cpu: `([^`]+)`", p.stdout, re.M))


def untagged_calls(result) -> set[str]:
    """Names of the call_function nodes the plug-in left outside every partition (getitem goes with its producer)."""
    return {
        n.name
        for n in result.tagged_exported_program.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem and n.meta.get("delegation_tag") is None
    }


def check_outputs(where, got, want, atol, rtol):
    assert len(got) == len(want), f"{where}: {len(got)} outputs, eager has {len(want)}"
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(got, want)) if (m := compare(g, w, atol, rtol))]
    assert not problems, f"{where}\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "case,dtype",
    [pytest.param(c, d, id=f"{c.name}-{d}") for c in zoo.CASES for d in c.dtypes],
)
def test_zoo_lowered_by_executorch_runs_in_etmetal(case, dtype, etmetal, tmp_path):
    module, inputs = zoo.instantiate(case, dtype)
    want = zoo.eager_outputs(module, inputs)
    recorder = RecordingPartitioner(FORWARD)
    et = lower(module, inputs, recorder)
    delegates, cpu_ops = plan_summary(et)
    pte = tmp_path / f"{case.name}.pte"
    pte.write_bytes(et.buffer)
    where = f"{case.name} [{dtype}]: {delegates} EtMetalBackend delegate(s), cpu ops {cpu_ops}"
    # The same decisions as the CLI on the same graph: as many partitions
    # (one delegate each), and the same nodes left outside them.
    cli_parts, cli_cpu = cli_partitions(etmetal.binary, recorder.pt2, tmp_path)
    assert len(recorder.tags) == cli_parts == delegates, (
        f"{where}; plug-in tags {sorted(recorder.tags)}, etmetal compile makes {cli_parts} partition(s)"
    )
    assert recorder.untagged == cli_cpu, (
        f"{where}; plug-in leaves {sorted(recorder.untagged)} untagged, etmetal compile keeps {sorted(cli_cpu)} on the cpu"
    )
    atol, rtol = case.tolerance(dtype)

    program = etm.load(pte)
    if delegates:
        assert program.device != "cpu", f"{where}: delegates but no GPU"
    check_outputs(f"{where}, etmetal.load", program.forward(*inputs), want, atol, rtol)

    p, outputs = cli_run(etmetal.binary, pte, inputs, tmp_path)
    assert p.returncode == 0, f"{where}\netmetal run failed:\n{p.stderr}"
    if delegates:
        assert "ran on gpu" in p.stdout, f"{where}\n{p.stdout}"
    check_outputs(f"{where}, etmetal run", outputs, want, atol, rtol)


class Reshaped(torch.nn.Module):
    """linear on [2, 8], then `inner` on [2, 2, 4]."""

    def __init__(self, inner):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.inner = inner

    def forward(self, x):
        return torch.relu(self.inner(self.lin(x).reshape(2, 2, 4)))


def test_unsupported_op_falls_back_to_portable_cpu_kernels(etmetal, tmp_path):
    # transposed convolution has no GPU kernel: the linear and relu are
    # delegated, the convolution is an ExecuTorch portable kernel call
    torch.manual_seed(0)
    module = Reshaped(torch.nn.ConvTranspose1d(2, 3, 3)).eval()
    x = torch.randn(2, 8)
    want = zoo.eager_outputs(module, (x,))
    recorder = RecordingPartitioner(FORWARD)
    et = lower(module, (x,), recorder)
    delegates, cpu_ops = plan_summary(et)
    assert delegates >= 1 and "aten::convolution" in cpu_ops, (delegates, cpu_ops)
    # the plug-in and the CLI split this graph the same way
    cli_parts, cli_cpu = cli_partitions(etmetal.binary, recorder.pt2, tmp_path)
    assert len(recorder.tags) == cli_parts == delegates, (recorder.tags, cli_parts, delegates)
    assert recorder.untagged == cli_cpu and any("convolution" in n for n in cli_cpu), (recorder.untagged, cli_cpu)
    pte = tmp_path / "fallback.pte"
    pte.write_bytes(et.buffer)
    program = etm.load(pte)
    assert program.device != "cpu"
    check_outputs("fallback, etmetal.load", program.forward(x), want, 1e-5, 1e-5)
    p, outputs = cli_run(etmetal.binary, pte, (x,), tmp_path)
    assert p.returncode == 0 and "ran on gpu" in p.stdout, p.stderr
    check_outputs("fallback, etmetal run", outputs, want, 1e-5, 1e-5)


def test_load_api(add_pte):
    pte = add_pte
    program = etm.load(pte)
    assert program.method_names == ["forward"]
    method = program.method("forward")
    assert method.input_specs() == [("float32", [2, 3]), ("float32", [2, 3])]
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    (out,) = method(a, torch.from_numpy(b))  # numpy and torch mix
    assert isinstance(out, np.ndarray) and np.array_equal(out, a + b)
    with pytest.raises(ValueError, match="input 0"):
        program.forward(np.ones((3, 3), np.float32), b)
    with pytest.raises(ValueError, match="no method `decode`"):
        program.method("decode")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        etm.load(pte, device="cpu")
    with pytest.raises(ValueError, match="device `tpu`"):
        etm.load(pte, device="tpu")
    # the tensor-core setting, as `etmetal run --coop` takes it
    (out,) = etm.load(pte, coop="off").forward(a, b)
    assert np.array_equal(out, a + b)
    with pytest.raises(ValueError, match="coop=`fast`: expected auto, all or off"):
        etm.load(pte, coop="fast")


class Int64Only(torch.nn.Module):
    def forward(self, a):
        return a + (1 << 40)


def test_program_without_delegates_runs_on_the_cpu(tmp_path):
    # int64 constants beyond the GPU's 32-bit integers keep the op on the CPU
    a = torch.arange(6).reshape(2, 3)
    et = lower(Int64Only(), (a,))
    assert plan_summary(et)[0] == 0
    pte = tmp_path / "int64.pte"
    pte.write_bytes(et.buffer)
    for device in ("cpu", "auto"):
        program = etm.load(pte, device=device)
        assert program.device == "cpu"
        (out,) = program.forward(a.numpy())
        assert out.dtype == np.int64 and np.array_equal(out, (a + (1 << 40)).numpy())


def test_quantize_compile_spec_makes_int4_weights(tmp_path):
    # `generate_quantize_compile_spec` is `etmetal compile --quantize int4`
    # inside ExecuTorch's lowering: the payload's weights are packed int4
    # (about a sixth of the f32 bytes with scales and zeros; large enough
    # that the 16 KiB alignment of each named-data entry does not dominate)
    # and the result is the dequantized model's, exactly so for weights
    # already on an int4 grid.
    from test_int4 import TOL, snap_int4

    torch.manual_seed(0)
    module = snap_int4(torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)), 32)
    x = torch.randn(3, 1024)
    want = zoo.eager_outputs(module, (x,))
    specs = [*FORWARD, EtMetalBackend.generate_quantize_compile_spec("int4", 32)]
    float_pte = lower(module, (x,)).buffer
    et = lower(module, (x,), EtMetalPartitioner(specs))
    assert plan_summary(et)[0] == 1
    assert len(et.buffer) < len(float_pte) * 0.3, (len(et.buffer), len(float_pte))
    pte = tmp_path / "int4.pte"
    pte.write_bytes(et.buffer)
    program = etm.load(pte)
    assert program.device != "cpu"
    check_outputs("int4 via compile spec", program.forward(x), want, *TOL["float32"])
    with pytest.raises(ValueError, match="only 'int4'"):
        EtMetalBackend.generate_quantize_compile_spec("int8")


def test_non_strict_recipe_decoder_steps_through_load(etmetal, tmp_path):
    """transformers' recipe exported with `strict=False` (its KV caches are
    lifted constants that the graph writes), compiled by `etmetal compile`
    and stepped token by token through `etmetal.load`'s `forward`, whose
    state persists between calls: every step's logits against eager, the
    caches on the GPU. (ExecuTorch's own lowering does not take such a
    program: torch's `run_decompositions` fails on the mutated constants.)"""
    from test_generate import CACHE, compile_pte, export_llm, resident_state, tiny

    wrapper = export_llm.recipe(tiny("llama"), CACHE)
    pt2 = tmp_path / "forward.pt2"
    torch.export.save(export_llm.export_step(wrapper, 1, strict=False), pt2)
    pte = tmp_path / "decoder.pte"
    report = compile_pte(etmetal, [pt2], pte)
    assert {"key_cache_0", "value_cache_1"} <= resident_state(report, "forward"), report
    program = etm.load(pte)
    assert program.device != "cpu"
    token = torch.tensor([[5]])
    with torch.no_grad():
        for pos in range(6):
            inputs = (token, torch.tensor([pos]))
            want = to_npy(wrapper.model(input_ids=inputs[0], cache_position=inputs[1]))
            (got,) = program.forward(*inputs)
            err = np.abs(got - want).max()
            assert err <= 1e-4 * np.abs(want).max(), f"step {pos} differs by {err:.3g}"
            token = torch.from_numpy(got[:, -1].argmax(-1, keepdims=True))
