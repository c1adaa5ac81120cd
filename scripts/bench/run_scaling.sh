#!/usr/bin/env bash
# The weak-scaling run on one 4- or 8-GPU node: scripts/bench/bench_scaling.py (ddp, zero1,
# fsdp2) at 1, 2, 4, 8 GPUs (up to the visible count), then HSDP against fsdp2 as two simulated
# nodes of N/2 GPUs (two torchrun launchers on localhost), then one summary table: tokens/s per GPU,
# weak-scaling efficiency against 1 GPU, HSDP / fsdp2, loss agreement with ddp over 20 steps.
#
#   scripts/bench/run_scaling.sh                         # GPU node, workload A; uses uv run
#   LITEGEN_PYTHON=python3 scripts/bench/run_scaling.sh  # a python that has the packages (no uv)
#   scripts/bench/run_scaling.sh --dry-run               # = DEVICE=cpu TINY=1: CPU, gloo, sizes
#                                                        #   1 2, HSDP 2 nodes x 1 rank (1-2 min)
#
# Environment: LITEGEN_PYTHON (interpreter), SCALING_OUT (JSON and logs; default
# results/scaling, results/scaling_cpu on CPU), SIZES (default "1 2 4 8" up to the GPU count;
# "1 2" on CPU), HSDP_SIZES (total GPUs of the HSDP launches; default the largest size; empty:
# none), DEVICE (cuda or cpu), TINY=1 (tiny model), BENCH_ARGS (extra bench_scaling.py
# arguments, e.g. "--compile --steps 10 --warmup 3").
# The summary covers every JSON in SCALING_OUT, so sizes can be run in separate calls (SIZES=8
# HSDP_SIZES= ..., then SIZES=4 HSDP_SIZES="4 8" ...); use a fresh SCALING_OUT for a new run.
# Exits non-zero when a launch failed or a loss is outside the bf16 tolerance of ddp's.
set -u
cd "$(dirname "$0")/../.."

if [ "${1:-}" = "--dry-run" ]; then
    DEVICE=cpu
    TINY=1
fi
source scripts/_python.sh
DEVICE=${DEVICE:-cuda}
# `python -m torch.distributed.run` is torchrun, with the interpreter chosen above.
TORCHRUN=("${PY[@]}" -m torch.distributed.run)
BENCH=(-m scripts.bench.bench_scaling --device "$DEVICE" ${BENCH_ARGS:-})
if [ "${TINY:-0}" = "1" ]; then
    BENCH+=(--tiny)
fi

if [ "$DEVICE" = cpu ]; then
    # CPU ranks talk over gloo on the loopback interface; no GPU count to respect.
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
    SIZES=${SIZES:-1 2}
    OUT=${SCALING_OUT:-results/scaling_cpu} # results/ is git-ignored; CPU apart from GPU runs
else
    NGPU=$("${PY[@]}" -c "import torch; print(torch.cuda.device_count())")
    if [ "$NGPU" -lt 1 ]; then
        echo "no CUDA device visible; use --dry-run for the CPU run" >&2
        exit 2
    fi
    SIZES=${SIZES:-$(for n in 1 2 4 8; do [ "$n" -le "$NGPU" ] && echo "$n"; done)}
    OUT=${SCALING_OUT:-results/scaling}
fi
mkdir -p "$OUT"
SIZES=$(echo $SIZES) # one line
HSDP_SIZES=${HSDP_SIZES-${SIZES##* }} # set but empty: no HSDP launch
failed=0

# 1. Weak scaling: one single-node launch per size, batch per GPU fixed.
for n in $SIZES; do
    echo "== $n rank(s): ddp zero1 fsdp2 (log $OUT/n$n.log)"
    rm -f "$OUT/n$n.json" # a failed launch must not leave an older result for the summary
    if ! "${TORCHRUN[@]}" --standalone --nproc_per_node="$n" "${BENCH[@]}" \
        --out "$OUT/n$n.json" >"$OUT/n$n.log" 2>&1; then
        echo "   FAILED; last lines:" && tail -n 5 "$OUT/n$n.log"
        failed=1
    fi
done

# 2. HSDP: two launchers on this host are two nodes of n/2 ranks each, so LiteGen's plan sees
# nnodes=2 and HSDP replicates across them; fsdp2 runs in the same group on the same GPUs.
for n in $HSDP_SIZES; do
    half=$((n / 2))
    if [ "$half" -lt 1 ] || [ $((2 * half)) -ne "$n" ]; then
        echo "== HSDP on $n rank(s): skipped, needs an even count of at least 2"
        continue
    fi
    port=$("${PY[@]}" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
    node=(--nnodes 2 --nproc_per_node "$half" --rdzv_backend c10d --rdzv_endpoint "localhost:$port")
    echo "== HSDP 2 nodes x $half rank(s): hsdp fsdp2 (log $OUT/hsdp$n.log)"
    rm -f "$OUT/hsdp$n.json"
    gpus0="" gpus1=""
    if [ "$DEVICE" = cuda ]; then
        gpus0=$(seq -s, 0 $((half - 1)))
        gpus1=$(seq -s, "$half" $((n - 1)))
    fi
    CUDA_VISIBLE_DEVICES=$gpus0 "${TORCHRUN[@]}" "${node[@]}" --node_rank 0 "${BENCH[@]}" --hsdp \
        --out "$OUT/hsdp$n.json" >"$OUT/hsdp$n.log" 2>&1 &
    first=$!
    # Node 1 writes no JSON: rank 0 of the job writes it, and either launcher may host rank 0.
    CUDA_VISIBLE_DEVICES=$gpus1 "${TORCHRUN[@]}" "${node[@]}" --node_rank 1 "${BENCH[@]}" --hsdp \
        --out "$OUT/hsdp$n.json" >"$OUT/hsdp$n.node1.log" 2>&1
    second=$?
    wait "$first"
    if [ $(($? + second)) -ne 0 ]; then
        echo "   FAILED; last lines:" && tail -n 5 "$OUT/hsdp$n.log" "$OUT/hsdp$n.node1.log"
        failed=1
    fi
done

# 3. The summary, last.
shopt -s nullglob
results=("$OUT"/*.json)
if [ "${#results[@]}" -eq 0 ]; then
    echo "no results in $OUT" >&2
    exit 1
fi
"${PY[@]}" -m scripts.bench.bench_scaling --summary "${results[@]}" || failed=1
exit "$failed"
