#!/usr/bin/env bash
# Run the Python parity suite (tests/parity) against a built etmetal binary.
#
#   scripts/run-parity.sh [VENV] [PYTEST_ARGS...]
#
# VENV: a venv with torch + executorch + pytest (scripts/setup-python.sh makes
# one); default $ETMETAL_VENV, else $HOME/.cache/etmetal/venv. The first
# argument is taken as VENV only when it is a directory not starting with '-'.
# Binary: $ETMETAL_BIN, default ${CARGO_TARGET_DIR:-target}/release/etmetal.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

venv="${ETMETAL_VENV:-$HOME/.cache/etmetal/venv}"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ] && [ -d "$1" ]; then
  venv="$1"
  shift
fi
python="$venv/bin/python"
if [ ! -x "$python" ]; then
  echo "run-parity: no python at $python (make the venv with scripts/setup-python.sh)" >&2
  exit 2
fi

bin="${ETMETAL_BIN:-${CARGO_TARGET_DIR:-target}/release/etmetal}"
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "run-parity: etmetal binary not found at $bin" >&2
  echo "run-parity: build it with 'cargo build --release -p etmetal' or set ETMETAL_BIN" >&2
  exit 2
fi
export ETMETAL_BIN="$bin"

parallel=()
if "$python" -c "import xdist" 2>/dev/null; then
  parallel=(-n auto)
fi
# A run writes about 6.6 GB of exports and .pte files under pytest's temp
# directory, and pytest keeps the last three runs': keep only the failed
# tests' files, of the last run, so repeated runs do not fill the disk.
exec "$python" -m pytest tests/parity -q "${parallel[@]}" \
  -o tmp_path_retention_count=1 -o tmp_path_retention_policy=failed "$@"
