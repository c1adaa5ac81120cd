#!/usr/bin/env bash
# GPU CI, run by a maintainer on a GPU node before a release and after every change to a CUDA
# path (offload, compile, kernels, attention, precision, strategies, memory). Five checks, then
# one table; exits non-zero when any check failed:
#
#   1. the GPU-marked tests (`pytest -m gpu tests/gpu`);
#   2. a short `litegen launch` of the digits recipe under every strategy the visible GPUs allow;
#   3. speed on a real model: diffusers' DiT-XL/2, compiled, `litegen launch` against the
#      hand-written loop (scripts/bench/bench_launch.py), samples/s ratio at least
#      SMOKE_MIN_RATIO;
#   4. offload on a real model: diffusers' Wan 2.1 1.3B, half its blocks checkpointed, with and
#      without activation offload (scripts/bench/bench_memory_real.py): the peak falls by at least
#      60% of the bytes offloaded per step, with the same number of steps timed;
#   5. fine-tuning speed: recipes/finetune_video.yaml on Wan 2.1 1.3B's shapes (random weights) at
#      a reduced size (256 px, 17 frames) against the hand-written peft LoRA loop, compiled
#      (scripts/bench/finetune_vs_hand.py); reports the samples/s ratio, fails only on a crash.
#
#   .ci/gpu_smoke.sh                          # dev machine: uses `uv run --no-sync python`
#   LITEGEN_PYTHON=python3 .ci/gpu_smoke.sh   # a python that has the packages (no uv), with
#                                             # the repository root on PYTHONPATH (docs/install.md)
#
# About 11 minutes on one H200 (check 5 about 4 of them, the first time). Environment:
# LITEGEN_PYTHON (interpreter), SMOKE_STEPS (launch steps, default 20), SMOKE_OUT (logs and
# results; default smoke_results), SMOKE_STRATEGIES (default: every registered strategy),
# SMOKE_MIN_RATIO (default 0.98), SMOKE_SKIP (checks to leave out, by number: SMOKE_SKIP="3 4 5"
# runs the tests and the launches only), SMOKE_WORK (check 5's pipeline folder and cache, about
# 4 GB, kept for the next run; default /tmp/finetune_vs_hand, as scripts/bench/finetune_vs_hand.py).
set -u
cd "$(dirname "$0")/.."

source scripts/_python.sh
STEPS=${SMOKE_STEPS:-20}
OUT=${SMOKE_OUT:-smoke_results}
MIN_RATIO=${SMOKE_MIN_RATIO:-0.98}
SKIP=" ${SMOKE_SKIP:-} "
mkdir -p "$OUT"
NGPU=$("${PY[@]}" -c "import torch; print(torch.cuda.device_count())")
STRATEGIES=${SMOKE_STRATEGIES:-$("${PY[@]}" -c \
    "from litegen.parallel import STRATEGIES; print(' '.join(STRATEGIES))")}
declare -a NAMES RESULTS NOTES SECONDS_TAKEN
record() { NAMES+=("$1"); RESULTS+=("$2"); NOTES+=("$3"); SECONDS_TAKEN+=("$((SECONDS - started))"); }
wanted() { [[ "$SKIP" != *" $1 "* ]]; }

if [ "$NGPU" -lt 1 ]; then
    echo "no CUDA device visible; this script is for GPU nodes" >&2
    exit 2
fi

# 1. GPU-marked tests.
if wanted 1; then
    started=$SECONDS
    "${PY[@]}" -m pytest -q -m gpu tests/gpu >"$OUT/pytest_gpu.log" 2>&1
    status=$?
    # pytest's summary line; process-group warnings at exit may print after it.
    summary=$(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest_gpu.log" | tail -n 1)
    if [ "$status" -eq 0 ]; then
        record "pytest -m gpu" PASS "$summary"
    else
        record "pytest -m gpu" FAIL "$summary (see $OUT/pytest_gpu.log)"
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
    wanted 2 || break
    started=$SECONDS
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
        # One GPU: ddp and fsdp2 train unwrapped (their single-rank path), fsdp1 wraps.
        if [ "$NGPU" -lt 2 ] && [[ " ddp fsdp1 fsdp2 " != *" $strategy "* ]]; then
            record "launch $strategy" SKIP "needs a data-parallel size of at least 2"
            continue
        fi
        launch "$strategy" "$log" "${common[@]}" "launch.nproc_per_node=$NGPU"
        status=$?
        note="$NGPU GPU(s), $STEPS steps"
    fi
    if [ "$status" -eq 0 ]; then
        record "launch $strategy" PASS "$note"
    else
        record "launch $strategy" FAIL "$note; last line: $(tail -n 1 "$log" | cut -c1-100)"
    fi
done

# 3. Speed on a real model: launch against the hand-written loop, compiled, one round each.
if wanted 3; then
    started=$SECONDS
    if "${PY[@]}" -m scripts.bench.bench_launch --models dit --variants compiled \
        --first 5 --last 15 --out "$OUT/real_model_speed.json" >"$OUT/real_model_speed.log" 2>&1; then
        read -r verdict note < <("${PY[@]}" - "$OUT/real_model_speed.json" "$MIN_RATIO" <<'EOF'
import json, sys
row = json.load(open(sys.argv[1]))["rows"][0]
ok = row["ratio"] >= float(sys.argv[2])
print("PASS" if ok else "FAIL", f"DiT-XL/2 compiled: launch/hand {row['ratio']:.3f} "
      f"({row['launch']:.1f} / {row['hand']:.1f} samples/s), need >= {sys.argv[2]}")
EOF
        )
        record "real-model speed" "$verdict" "$note"
    else
        record "real-model speed" FAIL "bench_launch failed (see $OUT/real_model_speed.log)"
    fi
fi

# 4. Offload on a real model: the peak falls by most of what is offloaded.
if wanted 4; then
    started=$SECONDS
    if "${PY[@]}" -m scripts.bench.bench_memory_real --variants half half_offload --frames 11 \
        --warmup 2 --steps 2 --out "$OUT/real_model_offload.json" \
        >"$OUT/real_model_offload.log" 2>&1; then
        read -r verdict note < <("${PY[@]}" - "$OUT/real_model_offload.json" <<'EOF'
import json, sys
rows = {r["variant"]: r for r in json.load(open(sys.argv[1]))["table"]}
plain, offload = rows["half"], rows["half_offload"]
saved, moved = plain["peak_gib"] - offload["peak_gib"], offload["offloaded_gib_per_step"]
print("PASS" if saved >= 0.6 * moved else "FAIL",
      f"Wan 1.3B half checkpointed: peak {plain['peak_gib']:.1f} -> {offload['peak_gib']:.1f} "
      f"GiB, {moved:.1f} GiB offloaded a step (need >= 60% of it saved)")
EOF
        )
        record "real-model offload" "$verdict" "$note"
    else
        record "real-model offload" FAIL "bench_memory_real failed (see $OUT/real_model_offload.log)"
    fi
fi

# 5. Fine-tuning speed: the video recipe against the hand-written peft LoRA loop, compiled.
if wanted 5; then
    started=$SECONDS
    if "${PY[@]}" -m scripts.bench.finetune_vs_hand --family wan --resolution 256 --frames 17 \
        --warmup 5 --window 5 --windows 2 --sides hand-compiled launch \
        --work "${SMOKE_WORK:-/tmp/finetune_vs_hand}" --summary "$OUT/finetune_speed.json" \
        >"$OUT/finetune_speed.log" 2>&1; then
        note=$("${PY[@]}" - "$OUT/finetune_speed.json" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
hand, launch = result["sides"]["hand-compiled"], result["sides"]["launch"]
print(f"Wan 1.3B LoRA {result['shape'].split()[1]}: recipe/hand compiled {launch['ratio']:.3f} "
      f"({launch['median']:.2f} / {hand['median']:.2f} samples/s; peak {launch['peak_gib']:.1f} "
      f"/ {hand['peak_gib']:.1f} GiB)")
EOF
        )
        record "finetune speed" PASS "$note"
    else
        record "finetune speed" FAIL "finetune_vs_hand failed (see $OUT/finetune_speed.log)"
    fi
fi

# 6. The table, last.
failed=0
printf '\n%-20s %-6s %5s  %s\n' check result s note
for i in "${!NAMES[@]}"; do
    printf '%-20s %-6s %5s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" "${NOTES[$i]}"
    [ "${RESULTS[$i]}" = FAIL ] && failed=1
done
printf 'total %d s on %d GPU(s); torch %s\n' "$SECONDS" "$NGPU" \
    "$("${PY[@]}" -c 'import torch; print(torch.__version__)')"
exit "$failed"
