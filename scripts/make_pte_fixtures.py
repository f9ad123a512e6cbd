#!/usr/bin/env python3
"""Write the small ExecuTorch `.pte` fixtures that `etmetal-pte` tests read.

Run with the project venv (torch 2.15, executorch 1.5.1):

    /root/.cache/etmetal/venv/bin/python scripts/make_pte_fixtures.py

For every module it writes `<name>.pte`, the inputs `<name>.input_<i>.npy`
and the outputs of ExecuTorch's own runtime `<name>.output_<i>.npy` (checked
against eager PyTorch here, so later runtime tests can compare with them).
Seeds are fixed so re-running gives the same weights.

    /root/.cache/etmetal/venv/bin/python scripts/make_pte_fixtures.py --check-roundtrip

instead rewrites every fixture with etmetal's writer (the `roundtrip`
example of etmetal-pte) and checks that ExecuTorch loads the rewritten file
and gives exactly the stored outputs.
"""

import glob
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from executorch.exir import to_edge, to_edge_transform_and_lower
from executorch.runtime import Runtime

OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "crates", "etmetal-pte", "tests", "fixtures"
)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
from models.mlp import Mlp  # noqa: E402


class LinearRelu(torch.nn.Module):
    """Linear(3,2) + relu (+ 1.0, which gives the 4-byte scalar constant)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return torch.relu(self.lin(x)) + 1.0


class ConvBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, kernel_size=3, padding=1)

    def forward(self, x):
        return torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)


class IntBool(torch.nn.Module):
    """int64 arithmetic and a bool mask, two outputs."""

    def forward(self, x, idx):
        mask = x > 0
        return torch.where(mask, x, torch.zeros_like(x)), idx * 2 + 1, mask


class XnnLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x)


def write(name, module, inputs, xnnpack=False):
    module.eval()
    exported = torch.export.export(module, inputs)
    if xnnpack:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    else:
        edge = to_edge(exported)
    program = edge.to_executorch()
    path = os.path.join(OUT, f"{name}.pte")
    with open(path, "wb") as f:
        f.write(program.buffer)

    # Run the written file in ExecuTorch and check it against eager PyTorch.
    method = Runtime.get().load_program(path).load_method("forward")
    got = method.execute(list(inputs))
    want = module(*inputs)
    want = list(want) if isinstance(want, tuple) else [want]
    assert len(got) == len(want), name
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        np.save(os.path.join(OUT, f"{name}.output_{i}.npy"), g.numpy())
    for i, t in enumerate(inputs):
        np.save(os.path.join(OUT, f"{name}.input_{i}.npy"), t.numpy())
    print(f"{name}.pte: {len(program.buffer)} bytes", file=sys.stderr)


def load_inputs(name):
    paths = sorted(glob.glob(os.path.join(OUT, f"{name}.input_*.npy")))
    return [torch.from_numpy(np.load(p)) for p in paths]


def check_roundtrip():
    names = sorted(os.path.basename(p)[: -len(".pte")] for p in glob.glob(os.path.join(OUT, "*.pte")))
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            written = os.path.join(tmp, f"{name}.pte")
            subprocess.run(
                ["cargo", "run", "-q", "-p", "etmetal-pte", "--example", "roundtrip", "--",
                 os.path.join(OUT, f"{name}.pte"), written],
                check=True,
            )
            got = Runtime.get().load_program(written).load_method("forward").execute(load_inputs(name))
            for i, g in enumerate(got):
                want = np.load(os.path.join(OUT, f"{name}.output_{i}.npy"))
                assert np.array_equal(g.numpy(), want), f"{name} output {i} differs"
            print(f"{name}: rewritten file runs in ExecuTorch, {len(got)} outputs identical", file=sys.stderr)


def main():
    if "--check-roundtrip" in sys.argv[1:]:
        check_roundtrip()
        return
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    write("linear_relu", LinearRelu(), (torch.randn(1, 3),))
    write("mlp", Mlp(), (torch.randn(2, 4),))
    write("conv_block", ConvBlock(), (torch.randn(1, 2, 6, 6),))
    write("int_bool", IntBool(), (torch.randn(2, 3), torch.arange(6, dtype=torch.int64).reshape(2, 3)))
    write("xnnpack_linear", XnnLinear(), (torch.randn(1, 8),), xnnpack=True)


if __name__ == "__main__":
    main()
