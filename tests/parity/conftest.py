"""Fixtures of the parity suite: the etmetal binary, wrapped in a `Runner`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner import Runner, default_binary


def pytest_addoption(parser):
    parser.addoption(
        "--etmetal-format",
        choices=("pt2", "pte"),
        default="pt2",
        help="run the .pt2 directly, or compile it to .pte (--backend cpu) first "
        "(test_gpu.py always compiles with --backend metal and runs on the GPU)",
    )


@pytest.fixture(scope="session")
def etmetal(request) -> Runner:
    binary = Path(os.environ.get("ETMETAL_BIN") or default_binary())
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        # Not a skip: a suite that passes without the binary would prove nothing.
        pytest.exit(
            f"etmetal binary not found or not executable at {binary}; build it with "
            "`cargo build --release -p etmetal` or set ETMETAL_BIN",
            returncode=4,
        )
    return Runner(binary, request.config.getoption("--etmetal-format"))


@pytest.fixture(scope="session")
def etmetal_gpu(etmetal) -> Runner:
    return Runner(etmetal.binary, "gpu")
