#!/usr/bin/env bash
# GPU CI smoke run: the GPU-marked tests, then a short `litegen launch` of every strategy on all
# visible GPUs, then a pass/fail table. Exits non-zero when anything failed.
#
#   scripts/gpu_smoke.sh                          # dev machine: uses `uv run --no-sync python`
#   LITEGEN_PYTHON=python3 scripts/gpu_smoke.sh   # a python that has the packages (no uv)
#
# Environment: LITEGEN_PYTHON (interpreter), SMOKE_STEPS (default 20), SMOKE_OUT (logs and
# results; default smoke_results), SMOKE_STRATEGIES (default: every registered strategy),
# SMOKE_SKIP_TESTS=1 (only the launches).
set -u
cd "$(dirname "$0")/.."

source scripts/_python.sh
STEPS=${SMOKE_STEPS:-20}
OUT=${SMOKE_OUT:-smoke_results}
mkdir -p "$OUT"
NGPU=$("${PY[@]}" -c "import torch; print(torch.cuda.device_count())")
STRATEGIES=${SMOKE_STRATEGIES:-$("${PY[@]}" -c \
    "from litegen.parallel import STRATEGIES; print(' '.join(STRATEGIES))")}
declare -a NAMES RESULTS NOTES
record() { NAMES+=("$1"); RESULTS+=("$2"); NOTES+=("$3"); }

if [ "$NGPU" -lt 1 ]; then
    echo "no CUDA device visible; this script is for GPU nodes" >&2
    exit 2
fi

# 1. GPU-marked tests.
if [ "${SMOKE_SKIP_TESTS:-0}" != "1" ]; then
    if "${PY[@]}" -m pytest -q -m gpu tests/gpu >"$OUT/pytest_gpu.log" 2>&1; then
        record "pytest -m gpu" PASS "$(tail -n 1 "$OUT/pytest_gpu.log")"
    else
        record "pytest -m gpu" FAIL "$(tail -n 1 "$OUT/pytest_gpu.log") (see $OUT/pytest_gpu.log)"
    fi
fi

# 2. A short launch of the digits recipe per strategy, on every visible GPU.
# `python -c` stands in for the `litegen` console script, which a plain python may lack.
CLI=("${PY[@]}" -c "import sys; from litegen_cli.app import main; sys.exit(main())")
launch() {  # launch <name> <log> <overrides...>
    local name=$1 log=$2
    shift 2
    "${CLI[@]}" launch recipes/digits_dit.yaml runtime.device=cuda "max_steps=$STEPS" \
        trainer.log_every=5 "results_dir=$OUT/$name" "$@" >"$log" 2>&1
}

for strategy in $STRATEGIES; do
    log="$OUT/launch_$strategy.log"
    common=("optimization.parallel.strategy=$strategy")
    if [ "$strategy" = hsdp ]; then
        # HSDP needs two nodes: two launchers on this host, each with half the GPUs.
        if [ "$NGPU" -lt 2 ]; then
            record "launch $strategy" SKIP "needs 2 GPUs to simulate 2 nodes"
            continue
        fi
        half=$((NGPU / 2))
        port=$((29500 + RANDOM % 1000))
        node=("launch.nnodes=2" "launch.nproc_per_node=$half"
            "launch.rdzv_endpoint=localhost:$port")
        CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((half - 1))) \
            launch "$strategy" "$log" "${common[@]}" "${node[@]}" launch.node_rank=0 &
        first=$!
        CUDA_VISIBLE_DEVICES=$(seq -s, "$half" $((2 * half - 1))) \
            launch "$strategy" "$log.node1" "${common[@]}" "${node[@]}" launch.node_rank=1
        second=$?
        wait "$first"
        status=$(($? + second))
        note="2 simulated nodes x $half GPU(s)"
    else
        if [ "$NGPU" -lt 2 ] && [ "$strategy" != ddp ] && [ "$strategy" != fsdp1 ]; then
            record "launch $strategy" SKIP "needs a data-parallel size of at least 2"
            continue
        fi
        launch "$strategy" "$log" "${common[@]}" "launch.nproc_per_node=$NGPU"
        status=$?
        note="$NGPU GPU(s), $STEPS steps"
    fi
    if [ "$status" -eq 0 ]; then
        record "launch $strategy" PASS "$note"
    elif grep -q "NotImplementedError" "$log"; then
        record "launch $strategy" SKIP "not implemented yet (see $log)"
    else
        record "launch $strategy" FAIL "$note; last line: $(tail -n 1 "$log" | cut -c1-100)"
    fi
done

# 3. The table, last.
failed=0
printf '\n%-18s %-6s %s\n' check result note
for i in "${!NAMES[@]}"; do
    printf '%-18s %-6s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${NOTES[$i]}"
    [ "${RESULTS[$i]}" = FAIL ] && failed=1
done
exit "$failed"
