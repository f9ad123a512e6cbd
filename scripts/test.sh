#!/usr/bin/env bash
# The whole test suite, on a fresh machine or a warm one:
#   formatting and lints, `cargo test --workspace`, then the Python parity
#   suite (eager PyTorch vs etmetal) in a venv made by setup-python.sh.
# Builds go to $CARGO_TARGET_DIR (default $HOME/.cache/etmetal/target) so a
# fresh clone reuses earlier builds.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/etmetal/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start ))s)"; }

step "setup: software Vulkan (Mesa lavapipe) for the GPU tests"
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    apt="$sudo env DEBIAN_FRONTEND=noninteractive apt-get -qq"
    $apt update >/dev/null
    $apt install -y --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
fi

step "setup: python venv"
venv=$(bash scripts/setup-python.sh | tail -n 1)

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
step "cargo test --workspace"
cargo test --workspace --quiet
step "cargo build --release"
cargo build --release --quiet -p etmetal
cargo build --release --quiet -p etmetal-pte --example roundtrip
cargo build --release --quiet -p etmetal --example generate
step "python package (maturin develop --release into the venv)"
# Its own Cargo workspace (python/); the target dir persists so rebuilds are incremental.
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$HOME/.cache/etmetal/target-python" \
    "$venv/bin/maturin" develop --release --quiet --manifest-path python/Cargo.toml
step "parity suite"
ETMETAL_BIN="$CARGO_TARGET_DIR/release/etmetal" bash scripts/run-parity.sh "$venv"
step "all tests passed"
