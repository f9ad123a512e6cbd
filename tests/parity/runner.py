"""The one function that runs a model with the etmetal binary (`Runner.run`):
write inputs as .npy, run (compiling to .pte first when asked), read outputs."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120
# a decoder's steps replayed by `generate` (several methods, loads included)
REPLAY_TIMEOUT_S = 600


def default_binary() -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return (target if target.is_absolute() else REPO / target) / "release" / "etmetal"


@dataclass
class Result:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    outputs: list[np.ndarray]  # output_0.npy, output_1.npy, ... (empty on failure)

    def describe(self) -> str:
        return f"$ {' '.join(self.cmd)}\nexit {self.returncode}\n--- stderr ---\n{self.stderr}--- stdout ---\n{self.stdout}"


def to_npy(t: torch.Tensor) -> np.ndarray:
    """numpy has no bf16: bf16 travels as float32 (exact; etmetal rounds it back)."""
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy()


# How a run goes: the program file it runs, `compile` flags, `run --device`.
FORMATS = {
    "pt2": (None, "cpu"),  # the .pt2 interpreted on CPU kernels
    "pte": (["--backend", "cpu"], "cpu"),  # compiled to portable kernels
    "gpu": (["--backend", "metal"], "auto"),  # GPU partitions + CPU fallback
}


@dataclass
class Runner:
    binary: Path
    fmt: str  # a key of FORMATS

    def _exec(self, args: list[str], timeout: int = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
        cmd = [str(self.binary), *args]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"$ {' '.join(cmd)}\ntimed out after {timeout}s\n{e.stderr or ''}")

    def replay(self, pte: Path, steps: list, folder: Path, *flags: str) -> subprocess.CompletedProcess:
        """`etmetal generate --replay` of `pte`: each `(method, inputs)` of
        `steps` in turn on one state, its outputs written as
        folder/step{k}_output{i}.npy; `flags` go to `generate`."""
        for k, (method, inputs) in enumerate(steps):
            (folder / f"step{k}_method.txt").write_text(method)
            for i, t in enumerate(inputs):
                np.save(folder / f"step{k}_input{i}.npy", to_npy(t))
        return self._exec(["generate", str(pte), *flags, "--replay", str(folder), "--steps", str(len(steps))],
                          timeout=REPLAY_TIMEOUT_S)

    def run(self, pt2: Path, inputs: tuple, work: Path) -> Result:
        """Run the program saved at `pt2` on `inputs` (written as .npy under
        `work`); read back every output_<i>.npy it writes."""
        work.mkdir(parents=True, exist_ok=True)
        program = pt2
        compile_flags, device = FORMATS[self.fmt]
        compiled = ""
        if compile_flags is not None:
            program = pt2.with_suffix(".pte")
            p = self._exec(["compile", str(pt2), "-o", str(program), *compile_flags])
            if p.returncode != 0:
                return Result(p.args, p.returncode, p.stdout, p.stderr, [])
            compiled = p.stdout
        paths = []
        for i, t in enumerate(inputs):
            path = work / f"input_{i}.npy"
            np.save(path, to_npy(t))
            paths.append(str(path))
        assert not any("," in p for p in paths), f"--inputs is comma-separated; bad work dir {work}"
        out_dir = work / "out"
        args = ["run", str(program), "--output-dir", str(out_dir), "--device", device]
        if paths:
            args[2:2] = ["--inputs", ",".join(paths)]
        p = self._exec(args)
        outputs = []
        if p.returncode == 0:
            while (out_dir / f"output_{len(outputs)}.npy").exists():
                outputs.append(np.load(out_dir / f"output_{len(outputs)}.npy"))
        return Result(p.args, p.returncode, compiled + p.stdout, p.stderr, outputs)
