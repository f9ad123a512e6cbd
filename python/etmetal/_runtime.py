"""`etmetal.load`: run a `.pte` with etmetal's runtime from Python."""

from __future__ import annotations

import os
from typing import Dict, List, Sequence

import numpy as np

from . import _etmetal

# NumPy has no bfloat16: bf16 goes in as raw bits (from torch) or as float32
# (rounded by the runtime) and comes out as float32, as `etmetal run` writes it.
_NUMPY = {
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "bool": np.bool_,
}


def _raw(i: int, t) -> tuple:
    """`(dtype name, shape, bytes)` of a torch tensor or anything NumPy takes."""
    if type(t).__module__.startswith("torch"):
        import torch

        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return ("bfloat16", list(t.shape), t.view(torch.int16).numpy().tobytes())
        t = t.numpy()
    a = np.ascontiguousarray(t)
    name = a.dtype.name
    if name not in _NUMPY:
        raise TypeError(f"input {i}: dtype {a.dtype} is not supported (supported: {', '.join(_NUMPY)}, bfloat16)")
    return (name, list(a.shape), a.tobytes())


def _array(dtype: str, shape: Sequence[int], data: bytes) -> np.ndarray:
    if dtype == "bfloat16":
        bits = np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(data, dtype=_NUMPY[dtype]).reshape(shape).copy()


class Method:
    """One method of a loaded program, ready to run."""

    def __init__(self, method: _etmetal.Method) -> None:
        self._method = method

    @property
    def name(self) -> str:
        return self._method.name

    def input_specs(self) -> List[tuple]:
        """`(dtype name, shape)` of each input; a dynamic input's shape is
        its upper bound (see `dynamic_inputs`)."""
        return self._method.input_specs()

    def dynamic_inputs(self) -> List[List[bool]]:
        """For each input, which dims are dynamic: any size up to the shape
        `input_specs` gives (a program exported with `torch.export.Dim`)."""
        return self._method.dynamic_inputs()

    def execute(self, *tensors) -> List[np.ndarray]:
        """Run on NumPy arrays or torch tensors; the outputs as NumPy arrays."""
        raw = [_raw(i, t) for i, t in enumerate(tensors)]
        return [_array(*out) for out in self._method.execute(raw)]

    __call__ = execute


class Program:
    """A `.pte` loaded by etmetal's runtime; see `load`."""

    def __init__(self, path: str | os.PathLike, device: str = "auto", coop: str | None = None) -> None:
        self._program = _etmetal.Program(os.fspath(path), device, coop)
        self._methods: Dict[str, Method] = {}

    @property
    def device(self) -> str:
        """`cpu`, or the GPU adapter the `EtMetalBackend` delegates run on."""
        return self._program.device

    @property
    def method_names(self) -> List[str]:
        return self._program.method_names()

    def method(self, name: str) -> Method:
        """Method `name`, loaded (its delegates on the device) the first time."""
        if name not in self._methods:
            self._methods[name] = Method(self._program.method(name))
        return self._methods[name]

    def forward(self, *tensors) -> List[np.ndarray]:
        return self.method("forward").execute(*tensors)

    __call__ = forward


def load(path: str | os.PathLike, device: str = "auto", coop: str | None = None) -> Program:
    """Load a `.pte`. `device` is `etmetal run --device`'s: `auto`, `metal`,
    `vulkan`, `dx12` or `cpu`. A file with `EtMetalBackend` delegates needs a
    GPU adapter (an error otherwise); one without runs on the CPU kernels.
    `coop` is `--coop`'s: `auto` (tensor-core forms where they measure
    faster on the GPU), `all` or `off`; `None` takes `ETMETAL_COOP`, else
    `auto`."""
    return Program(path, device, coop)
