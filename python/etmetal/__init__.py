"""etmetal for ExecuTorch.

    from etmetal import EtMetalPartitioner, EtMetalBackend
    lowered = to_edge_transform_and_lower(
        ep, partitioner=[EtMetalPartitioner([EtMetalBackend.generate_method_name_compile_spec("forward")])])
    program = etmetal.load("model.pte"); outputs = program.forward(x)

or, without ExecuTorch, `etmetal compile`'s pipeline and flags from Python:

    open("model.pte", "wb").write(etmetal.compile(ep, dtype="bf16"))

The partitioner and backend need torch and executorch; `load` needs only NumPy.
"""

from ._compile import compile
from ._etmetal import BACKEND_ID
from ._runtime import Method, Program, load

__all__ = ["BACKEND_ID", "EtMetalBackend", "EtMetalPartitioner", "Method", "Program", "compile", "load"]


def __getattr__(name):
    # imported on first use: torch and executorch load slowly and a runtime-only
    # user may not have them
    if name in ("EtMetalBackend", "EtMetalPartitioner"):
        from . import _aot

        return getattr(_aot, name)
    raise AttributeError(f"module 'etmetal' has no attribute {name!r}")
