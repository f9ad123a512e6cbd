#!/usr/bin/env bash
# The tensor-core crash reproducer (README, Tensor cores): on the H200 the
# `gpu_matmul` test binary, run with its default thread count and
# cooperative-matrix kernels on, died in NVIDIA's shader compiler
# (libnvidia-glsi, driver 580.159) in 2 of 3 runs.
#
#   bash scripts/coop_crash.sh build   # here: builds the binaries into .bench/coop/
#   bash scripts/coop_crash.sh run [crash|stress|locks]...
#       # on the GPU machine (carry .gl and .bench/coop); each part appends
#       # to $OUT/coop_crash.txt (or ./coop_crash.txt); all three by default.
#       # TIMES=N repeats the test binary N times (10); LOCKS="device all"
#       # picks the lock settings `locks` tries.
#       # A device command may run 10 minutes: give each part its own call
#       # if the first takes long.
#
# `run` answers, in order:
#  1. does the crash come back: the test binary 10 times multi-threaded with
#     no workaround (ETMETAL_PIPELINE_LOCK=off), and once single-threaded;
#  2. which pattern causes it (examples/coop_stress.rs): one kernel at a
#     time; concurrent builds on one device; builds on several devices at
#     once; devices opened and dropped beside builds;
#  3. which workaround holds: the test binary 10 times multi-threaded under
#     each lock setting (coop: tensor-core kernels one at a time, tried
#     before and not enough; device: every kernel on a device with
#     cooperative matrices; all: every kernel of the process).
# NVIDIA's on-disk shader cache is off (__GL_SHADER_DISK_CACHE=0), so every
# build reaches the compiler; CACHE=1 leaves it on (a crash that only
# shows with the cache off is itself an answer).
#
# Reading the result: a setting with 10/10 passes where `off` fails is the
# workaround; make it the default for devices with cooperative matrices
# (PipelineLock::get in crates/etmetal-metal-runtime/src/device.rs), and
# `--coop auto` the default only after the unchanged test binary passes 10
# multi-threaded runs in a row on the H200 under that default.
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
    [ ${#parts[@]} -gt 0 ] || parts=(crash stress locks)
    {
        date -u
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        ETMETAL_PIPELINE_LOCK=off $DIR/coop_stress list 2>&1 | grep -v '^begin'
    } >>"$REPORT"
    for part in "${parts[@]}"; do
        case $part in
        crash)
            # 1. the crash, unchanged (the binary's default: a test thread a core)
            ETMETAL_PIPELINE_LOCK=off repeat "gpu_matmul off x$threads" ${TIMES:-10} $DIR/gpu_matmul
            ETMETAL_PIPELINE_LOCK=off repeat "gpu_matmul off single-threaded" 1 $DIR/gpu_matmul --test-threads=1
            ;;
        stress)
            # 2. the patterns, no lock; then concurrent builds under each lock
            export ETMETAL_PIPELINE_LOCK=off
            repeat "stress kernel" 1 $DIR/coop_stress kernel --rounds 20
            repeat "stress threads" 5 $DIR/coop_stress threads --threads "$threads" --rounds 5
            repeat "stress devices" 5 $DIR/coop_stress devices --threads 8 --rounds 3
            repeat "stress churn" 5 $DIR/coop_stress churn --threads 4 --rounds 5
            for lock in coop device all; do
                ETMETAL_PIPELINE_LOCK=$lock repeat "stress threads lock=$lock" 5 \
                    $DIR/coop_stress threads --threads "$threads" --rounds 5
            done
            unset ETMETAL_PIPELINE_LOCK
            ;;
        locks)
            # 3. the test binary under each lock
            # (`coop` last: it already failed once before)
            for lock in ${LOCKS:-device all coop}; do
                ETMETAL_PIPELINE_LOCK=$lock repeat "gpu_matmul lock=$lock x$threads" ${TIMES:-10} $DIR/gpu_matmul
            done
            ;;
        *)
            echo "unknown part $part: crash, stress or locks" >&2
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
