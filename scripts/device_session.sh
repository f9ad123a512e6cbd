#!/usr/bin/env bash
# One GPU-machine call does everything an H200 session still owes the
# issues (README "Devices"): each start of that machine costs minutes and
# loans are scarce, so the parts run back to back in one command and
# write everything under $OUT.
#
#   bash scripts/device_session.sh build
#       here: the stripped `etmetal` binary into .bench/, and the
#       tensor-core crash binaries (scripts/coop_crash.sh build)
#   bash scripts/device_session.sh run PART...
#       there (carry .gl and .bench): parts, in the order given
#         info    GPU name and driver
#         crash   the tensor-core crash check, TIMES=10 multi-threaded runs
#         host    benchmarks/host_path.py (the host path, 1 KiB to 1 GiB)
#         int4    benchmarks/run.py prepare --only int4_gemv (exports the GEMV rows)
#         bench   benchmarks/run.py gpu --only "$ONLY" $BENCH_ARGS into $OUT/gpu_$TAG.json
#         variants benchmarks/variants.py $CASES into $OUT/variants_$TAG.json: every
#                 form of op rows (CASES='sdpa_10x20x1500:bf16 mm_4096:bf16'),
#                 PyTorch's kernel time in the same run beside them
#         ab      benchmarks/binaries.py $BINS $ROWS into $OUT/binaries_$TAG.json:
#                 binaries side by side (BINS='--bin main=.bench/main --bin new=.bench/etmetal';
#                 a wrapper script setting an environment switch serves as a binary too)
#       T bounds each part's seconds. Fold the JSON back here with
#       `python3 benchmarks/run.py merge FILE` and `run.py report`.
set -uo pipefail
cd "$(dirname "$0")/.."

build() {
    : "${CARGO_TARGET_DIR:=$HOME/.cache/etmetal/target}"
    export CARGO_TARGET_DIR
    cargo build --profile ci -p etmetal --bin etmetal || exit 1
    mkdir -p .bench
    cp "$CARGO_TARGET_DIR/ci/etmetal" .bench/etmetal && strip .bench/etmetal
    bash scripts/coop_crash.sh build
}

run() {
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export PYTHONUNBUFFERED=1 ETMETAL_BIN=$PWD/.bench/etmetal
    local out=${OUT:-/tmp/out}
    mkdir -p "$out"
    log() { echo "== $(date -u +%T) $*" | tee -a "$out/steps.txt"; }
    for part in "$@"; do
        log "$part"
        case $part in
        info) nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$out/steps.txt" ;;
        crash) TIMES=${TIMES:-10} timeout "${T:-400}" bash scripts/coop_crash.sh run crash ;;
        host)
            timeout "${T:-240}" python3 benchmarks/host_path.py --out "$out/host_path.json" >"$out/host_path.log" 2>&1
            tail -3 "$out/host_path.log"
            ;;
        int4)
            timeout "${T:-200}" python3 benchmarks/run.py prepare --only int4_gemv >"$out/prepare.log" 2>&1
            tail -3 "$out/prepare.log"
            ;;
        bench)
            # shellcheck disable=SC2086 # BENCH_ARGS: extra flags, split
            timeout "${T:-450}" python3 benchmarks/run.py gpu --only "${ONLY:?ONLY names the rows}" ${BENCH_ARGS:-} \
                --out "$out/gpu_${TAG:-rows}.json" >"$out/gpu_${TAG:-rows}.log" 2>&1
            tail -c 1500 "$out/gpu_${TAG:-rows}.log"
            ;;
        variants)
            # shellcheck disable=SC2086 # CASES: a list, split
            timeout "${T:-300}" python3 benchmarks/variants.py ${CASES:?CASES names the op rows} \
                --out "$out/variants_${TAG:-ops}.json" >"$out/variants_${TAG:-ops}.log" 2>&1
            grep -v '^{' "$out/variants_${TAG:-ops}.log" | tail -40
            ;;
        ab)
            # shellcheck disable=SC2086 # BINS, ROWS: lists, split
            timeout "${T:-450}" python3 benchmarks/binaries.py ${BINS:?BINS names the binaries} ${ROWS:?ROWS names the rows} \
                --out "$out/binaries_${TAG:-ab}.json" >"$out/binaries_${TAG:-ab}.log" 2>&1
            tail -c 1500 "$out/binaries_${TAG:-ab}.log"
            ;;
        *)
            echo "unknown part $part: info, crash, host, int4, bench, variants or ab" >&2
            exit 2
            ;;
        esac
    done
    log done
}

case "${1:-}" in
build) build ;;
run)
    shift
    run "$@"
    ;;
*)
    echo "usage: $0 build | run PART..." >&2
    exit 2
    ;;
esac
