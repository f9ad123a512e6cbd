#!/usr/bin/env bash
# The tensor-core crash reproducer (README, Tensor cores): on the H200 the
# `gpu_matmul` test binary, run with its default thread count and
# cooperative-matrix kernels on, died in NVIDIA's driver (the backtrace of
# an earlier session: libnvidia-glsi, driver 580.159) in 2 of 3 runs.
# 2026-12-05: 2 of 5 runs crashed; with every pipeline build of the process
# serialised 7 of 10 still did, so the builds were not the cause. The test
# binary's backend then re-opened its device when a later test needed
# larger limits, beside work on the old one, which was dropped when its
# delegates finished; now every backend shares one device per process,
# opened once with all the adapter offers (GpuDevice::shared).
# 2026-12-06 (H100): still 5 of 16 runs; a signal handler found the
# faulting thread exiting, in `free` inside `xcb_connect`: instances made
# and enumerated on several threads at once. With one instance per process
# (device.rs `enumerate`), 10 of 10 runs passed.
#
#   bash scripts/coop_crash.sh build   # here: builds the binaries into .bench/coop/
#   bash scripts/coop_crash.sh run [crash|stress]...
#       # on the GPU machine (carry .gl and .bench/coop); each part appends
#       # to $OUT/coop_crash.txt (or ./coop_crash.txt); both by default.
#       # TIMES=N repeats the test binary N times (10); SINGLE=0 skips
#       # its single-threaded run (for a check spread over several calls).
#
# `run` answers:
#  1. does the crash come back: the test binary TIMES times multi-threaded,
#     and once single-threaded; `--coop auto` may become the default once
#     it passes 10 multi-threaded runs in a row;
#  2. which pattern crashes (examples/coop_stress.rs): one kernel at a time;
#     concurrent builds on one device; devices opened and dropped beside
#     builds.
# NVIDIA's on-disk shader cache is off (__GL_SHADER_DISK_CACHE=0), so every
# build reaches the compiler; CACHE=1 leaves it on.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=.bench/coop

build() {
    : "${CARGO_TARGET_DIR:=$HOME/.cache/etmetal/target}"
    export CARGO_TARGET_DIR
    mkdir -p $DIR
    cargo build --profile ci -p etmetal --example coop_stress || exit 1
    cp "$CARGO_TARGET_DIR/ci/examples/coop_stress" $DIR/
    local exe
    exe=$(cargo test --profile ci -p etmetal --test gpu_matmul --no-run --message-format=json |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_matmul":
        print(m["executable"])') || exit 1
    cp "$exe" $DIR/gpu_matmul
    strip $DIR/coop_stress $DIR/gpu_matmul
    ls -la $DIR
}

# one line per run: what ran, its exit status (139 or 134: a crash) and
# the last `begin` line or test name it printed
attempt() {
    local label=$1
    shift
    local log
    log=$(mktemp)
    timeout 300 "$@" >"$log" 2>&1
    local rc=$?
    local last
    last=$(grep -E '^begin|^test ' "$log" | tail -1)
    echo "$label rc=$rc last: ${last:-none}" | tee -a "$REPORT"
    if [ $rc -ne 0 ]; then
        tail -30 "$log" >>"$REPORT.logs"
        echo "---- ($label)" >>"$REPORT.logs"
    fi
    rm -f "$log"
    return $rc
}

repeat() {
    local label=$1 times=$2
    shift 2
    local fails=0
    for i in $(seq 1 "$times"); do
        attempt "$label #$i" "$@" || fails=$((fails + 1))
    done
    echo "== $label: $fails of $times failed" | tee -a "$REPORT"
}

run() {
    [ -x $DIR/gpu_matmul ] && [ -x $DIR/coop_stress ] || {
        echo "no binaries in $DIR: run '$0 build' first and carry $DIR" >&2
        exit 1
    }
    REPORT=${OUT:-.}/coop_crash.txt
    touch "$REPORT" "$REPORT.logs"
    [ "${CACHE:-0}" = 1 ] || export __GL_SHADER_DISK_CACHE=0
    local threads parts=("$@")
    threads=$(nproc)
    [ ${#parts[@]} -gt 0 ] || parts=(crash stress)
    {
        date -u
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        $DIR/coop_stress list 2>&1 | grep -v '^begin'
    } >>"$REPORT"
    for part in "${parts[@]}"; do
        case $part in
        crash)
            # 1. the crash, unchanged (the binary's default: a test thread a core)
            repeat "gpu_matmul x$threads" ${TIMES:-10} $DIR/gpu_matmul
            [ "${SINGLE:-1}" = 0 ] || repeat "gpu_matmul single-threaded" 1 $DIR/gpu_matmul --test-threads=1
            ;;
        stress)
            # 2. the patterns
            repeat "stress kernel" 1 $DIR/coop_stress kernel --rounds 20
            repeat "stress threads" 5 $DIR/coop_stress threads --threads "$threads" --rounds 5
            repeat "stress churn" 5 $DIR/coop_stress churn --threads 4 --rounds 5
            ;;
        *)
            echo "unknown part $part: crash or stress" >&2
            exit 2
            ;;
        esac
    done
    echo "report: $REPORT (failed runs' output: $REPORT.logs)"
}

case "${1:-}" in
build) build ;;
run)
    shift
    run "$@"
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
