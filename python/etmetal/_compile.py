"""`etmetal.compile`: a `torch.export` program → the bytes of a `.pte`,
through the same pipeline and options as `etmetal compile` (the keywords
are its flags)."""

from __future__ import annotations

import io
import os
from typing import Iterable, Optional, Union

from . import _etmetal


def compile(
    program: Union["torch.export.ExportedProgram", bytes, str, os.PathLike],
    *,
    dtype: str = "f32",
    backend: str = "metal",
    partition: str = "auto",
    skip_ops: Iterable[str] = (),
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    quantize_skip: Iterable[str] = (),
    max_buffer: Optional[int] = None,
) -> bytes:
    """The `.pte` of `program`: an ExportedProgram, the bytes
    `torch.export.save` writes, or the path of a `.pt2`. `dtype` (`f32`,
    `bf16`, `f16`) computes in that float dtype, as `module.to(dtype)`:
    float inputs and outputs take it too."""
    if isinstance(program, (str, os.PathLike)):
        with open(program, "rb") as f:
            pt2 = f.read()
    elif isinstance(program, (bytes, bytearray)):
        pt2 = bytes(program)
    else:
        import torch  # only an ExportedProgram needs it

        buf = io.BytesIO()
        torch.export.save(program, buf)
        pt2 = buf.getvalue()
    return _etmetal.compile(
        pt2,
        dtype=dtype,
        backend=backend,
        partition=partition,
        skip_ops=list(skip_ops),
        quantize=quantize,
        group_size=group_size,
        quantize_skip=list(quantize_skip),
        max_buffer=max_buffer,
    )
