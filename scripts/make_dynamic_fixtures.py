#!/usr/bin/env python3
"""Write the dynamic-shape `.pte` fixtures that etmetal-runtime's tests read.

Run with the project venv (torch 2.15, executorch 1.5.1):

    /root/.cache/etmetal/venv/bin/python scripts/make_dynamic_fixtures.py

Each module is exported with a `torch.export.Dim` range and lowered with
ExecuTorch's own `to_edge(...).to_executorch()` (portable kernels, no
delegate), which plans its tensors at the upper bound (`DYNAMIC_BOUND`) and
emits the symbolic-int calls. For each size in SIZES it writes the inputs
`<name>.s<size>.input_<i>.npy` and what eager PyTorch gives for them
`<name>.s<size>.output_<i>.npy`. Seeds are fixed.
"""

import os
import sys

import numpy as np
import torch
from torch.export import Dim, export
from executorch.exir import to_edge

OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "crates", "etmetal-runtime", "tests", "fixtures"
)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
from dynamic_modules import MODULES  # noqa: E402


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, make, dim_of, sizes in MODULES:
        torch.manual_seed(0)
        module, example, dynamic_shapes = make()
        module.eval()
        ep = export(module, example, dynamic_shapes=dynamic_shapes)
        program = to_edge(ep).to_executorch()
        path = os.path.join(OUT, f"{name}.pte")
        with open(path, "wb") as f:
            f.write(program.buffer)
        for size in sizes:
            torch.manual_seed(size)
            inputs = dim_of(size)
            with torch.no_grad():
                outs = module(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            for i, t in enumerate(inputs):
                np.save(os.path.join(OUT, f"{name}.s{size}.input_{i}.npy"), t.numpy())
            for i, t in enumerate(outs):
                np.save(os.path.join(OUT, f"{name}.s{size}.output_{i}.npy"), t.numpy())
        print(f"{name}: {os.path.getsize(path)} bytes, sizes {sizes}")


if __name__ == "__main__":
    main()
