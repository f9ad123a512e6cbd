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

step "setup: software Vulkan (Mesa lavapipe) for the GPU tests, C/C++ tools for the C API's"
need=()
ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || need+=(mesa-vulkan-drivers libvulkan1)
# crates/etmetal-capi/tests/c_programs.rs builds a C and a C++ program
# (AddressSanitizer comes with gcc) against the library, through pkg-config
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    apt="$sudo env DEBIAN_FRONTEND=noninteractive apt-get -qq"
    $apt update >/dev/null
    $apt install -y --no-install-recommends "${need[@]}" >/dev/null
fi

step "setup: python venv"
venv=$(bash scripts/setup-python.sh | tail -n 1)

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
# One optimised profile (`ci`, with overflow and debug-assertion checks) for
# the unit tests, the binary, the examples and the Python package, so each
# crate is compiled once.
# (The C API's tests build its shared and static library, then the C
# example and the C++ error-path test against them, and run them on the CPU
# and on lavapipe: crates/etmetal-capi/tests/c_programs.rs.)
step "cargo test --workspace (profile ci)"
cargo test --workspace --quiet --profile ci
step "cargo build (profile ci): etmetal, examples"
cargo build --quiet --profile ci -p etmetal --bin etmetal
cargo build --quiet --profile ci -p etmetal-pte --example roundtrip
step "python package (maturin develop into the venv)"
# python/ is a workspace member: same lock, features, target dir and profile.
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" develop --quiet --profile ci --manifest-path python/Cargo.toml
step "parity suite"
bin="$CARGO_TARGET_DIR/ci"
ETMETAL_BIN="$bin/etmetal" ETMETAL_PTE_ROUNDTRIP="$bin/examples/roundtrip" bash scripts/run-parity.sh "$venv"
step "all tests passed"
