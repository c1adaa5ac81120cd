#!/usr/bin/env bash
# The video fine-tuning recipe at real size on one GPU: Wan2.1-T2V-1.3B's shapes with random
# weights (litegen_zoo.make_tiny_pipeline wan-1.3b), a folder of 480x832 clips of 49 frames,
# `litegen cache build`, then `litegen launch recipes/finetune_video.yaml` (LoRA, EMA, fsdp2)
# with one sample at the end; prints samples/s and the peak from the run's metrics.jsonl.
#
#   scripts/bench/finetune_video_real.sh                  # dev machine (uv)
#   LITEGEN_PYTHON=python3 scripts/bench/finetune_video_real.sh   # GPU node, docs/install.md
#
# Environment: WORK (scratch folder, default /tmp/finetune_real; the pipeline takes ~6 GB),
# STEPS (default 20), CLIPS (default 2), SAMPLE_STEPS (validation steps, default 4); for a
# quick CPU check of the script itself: FAMILY=wan SIZE=64x48 FRAMES=9 and EXTRA="finetune.data.resolution=48
# finetune.data.max_frames=9 trainer.validation.height=48 trainer.validation.width=64 trainer.validation.frames=9".
set -eu
cd "$(dirname "$0")/../.."
source scripts/_python.sh
WORK=${WORK:-/tmp/finetune_real}
STEPS=${STEPS:-20}
CLIPS=${CLIPS:-2}
SAMPLE_STEPS=${SAMPLE_STEPS:-4}
FAMILY=${FAMILY:-wan-1.3b}
SIZE=${SIZE:-832x480}
FRAMES=${FRAMES:-49}
read -r -a EXTRA_ARGS <<<"${EXTRA:-}"
mkdir -p "$WORK"
CLI=("${PY[@]}" -c "import sys; from litegen_cli.app import main; sys.exit(main())")
started=$SECONDS
lap() { echo "[$((SECONDS - started)) s] $*"; }

[ -f "$WORK/$FAMILY/model_index.json" ] ||
    "${PY[@]}" -m litegen_zoo.make_tiny_pipeline "$FAMILY" "$WORK/$FAMILY"
lap "pipeline folder ready"
"${PY[@]}" - "$WORK/media" "$CLIPS" "$SIZE" "$FRAMES" <<'PY'
import sys
from pathlib import Path
from tests.media import write_mp4
root, clips = Path(sys.argv[1]), int(sys.argv[2])
width, height = (int(n) for n in sys.argv[3].split("x"))
for i in range(clips):
    if not (root / f"clip_{i}.mp4").exists():
        write_mp4(root / f"clip_{i}.mp4", width, height, int(sys.argv[4]), fps=16)
        (root / f"clip_{i}.txt").write_text(f"a clip number {i}")
PY
lap "media folder ready"
common=(recipes/finetune_video.yaml "finetune.pipeline=$WORK/$FAMILY" "finetune.data.folder=$WORK/media"
    "finetune.data.cache_root=$WORK/cache" launch.nproc_per_node=1 "${EXTRA_ARGS[@]}")
"${CLI[@]}" cache build "${common[@]}" --nproc 1
lap "cache built"
rm -rf "$WORK/results"
"${CLI[@]}" launch "${common[@]}" "results_dir=$WORK/results" global_batch_size=1 \
    "max_steps=$STEPS" trainer.log_every=1 "trainer.sample_every=$STEPS" \
    "trainer.checkpoint_every=$STEPS" "trainer.validation.steps=$SAMPLE_STEPS"
lap "trained $STEPS steps"
"${PY[@]}" - "$WORK/results" <<'PY'
import json, sys, statistics
from pathlib import Path
results = Path(sys.argv[1])
records = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]
train = [r for r in records if "samples_per_s" in r]
later = train[len(train) // 2 : -1] or train[-1:]  # past warm-up, before the sampling step
rate = statistics.median(r["samples_per_s"] for r in later)
peak = max(r.get("peak_allocated_gib", 0.0) for r in records)
reserved = max(r.get("peak_reserved_gib", 0.0) for r in records)
samples = sorted(str(p.relative_to(results)) for p in results.rglob("samples*.mp4"))
print(f"samples/s (median of steps {later[0].get('step')}-{later[-1].get('step')}): {rate:.3f}")
print(f"peak allocated {peak:.2f} GiB, reserved {reserved:.2f} GiB; samples: {samples}")
PY
