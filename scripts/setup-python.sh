#!/usr/bin/env bash
# Make (or reuse) the Python venv used by the parity suite: torch + executorch.
# Path: $ETMETAL_VENV, default $HOME/.cache/etmetal/venv. Prints the venv path last.
set -euo pipefail
venv="${ETMETAL_VENV:-$HOME/.cache/etmetal/venv}"
stamp="$venv/.etmetal-ready-torch2.15.0-et1.5.1"
# Tools added after the stamp was first written: installed into old venvs too.
# The survey's model libraries (tests/parity/survey.py) come with torch pinned,
# so pip keeps the torchvision built for it; versions as tested.
# gguf and accelerate: transformers' GGUF loading (tests/parity/test_generate.py).
extras=("maturin>=1.5,<2" pytest-xdist torch==2.15.0 torchvision==0.29.2 transformers==5.25.0 timm==1.0.31 gguf==0.19.0 accelerate==1.16.0)
if [ -f "$stamp" ]; then
  if [ ! -x "$venv/bin/maturin" ] \
    || ! "$venv/bin/python" -c "import xdist, torchvision, transformers, timm, gguf, accelerate" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q "${extras[@]}" >&2
  fi
  echo "$venv"
  exit 0
fi
echo "setup-python: creating venv at $venv (torch 2.15.0, executorch 1.5.1; a few minutes)" >&2
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q \
  executorch==1.5.1 numpy pytest "${extras[@]}" >&2
touch "$stamp"
echo "$venv"
