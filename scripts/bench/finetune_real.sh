#!/usr/bin/env bash
# A fine-tuning recipe at real size on one GPU, as a user runs it: a pipeline folder with a
# published model's shapes and random weights (litegen_zoo.make_tiny_pipeline PIPE: wan-1.3b,
# wan-i2v-14b, flux-dev), a media folder (clips, or images when FRAMES=1), `litegen cache build`,
# then `litegen launch RECIPE` with one validation sample at the end; prints samples/s, the peak
# from the run's metrics.jsonl and the samples written (copied to $OUT when it is set).
#
#   scripts/bench/finetune_real.sh                                  # dev machine (uv): Wan 1.3B
#   LITEGEN_PYTHON=python3 scripts/bench/finetune_real.sh           # GPU node, docs/install.md
#   PIPE=wan-i2v-14b SIZE=832x480 FRAMES=81 EXTRA="finetune.data.resolution=632 \
#     finetune.data.max_frames=81 optimization.lora.fp8_base=rowwise ..." scripts/bench/finetune_real.sh
#   PIPE=flux-dev RECIPE=recipes/finetune_image.yaml SIZE=1024x1024 FRAMES=1 scripts/bench/finetune_real.sh
#
# Environment: WORK (scratch folder, default /tmp/finetune_real; Wan 1.3B's pipeline takes ~6 GB,
# the 14B's ~32 GB), PIPE (default wan-1.3b), RECIPE (default recipes/finetune_video.yaml), SIZE
# (WIDTHxHEIGHT, default 832x480), FRAMES (default 49; 1 writes PNG images), STEPS (default 20),
# CLIPS (default 2), SAMPLE_STEPS (validation steps, default 4), CHECKPOINT_EVERY (default STEPS;
# 0: no run checkpoint), EXTRA (more recipe overrides).
# A quick CPU check of the script itself: PIPE=wan SIZE=64x48 FRAMES=9 STEPS=2 and
# EXTRA="finetune.data.resolution=48 finetune.data.max_frames=9 trainer.validation.height=48
# trainer.validation.width=64 trainer.validation.frames=9".
set -eu
cd "$(dirname "$0")/../.."
source scripts/_python.sh
WORK=${WORK:-/tmp/finetune_real}
PIPE=${PIPE:-wan-1.3b}
RECIPE=${RECIPE:-recipes/finetune_video.yaml}
SIZE=${SIZE:-832x480}
FRAMES=${FRAMES:-49}
STEPS=${STEPS:-20}
CLIPS=${CLIPS:-2}
SAMPLE_STEPS=${SAMPLE_STEPS:-4}
read -r -a EXTRA_ARGS <<<"${EXTRA:-}"
mkdir -p "$WORK"
CLI=("${PY[@]}" -c "import sys; from litegen_cli.app import main; sys.exit(main())")
started=$SECONDS
lap() { echo "[$((SECONDS - started)) s] $*"; }

[ -f "$WORK/$PIPE/model_index.json" ] ||
    "${PY[@]}" -m litegen_zoo.make_tiny_pipeline "$PIPE" "$WORK/$PIPE"
lap "pipeline folder ready"
MEDIA="$WORK/media-${SIZE}x$FRAMES"
"${PY[@]}" - "$MEDIA" "$CLIPS" "$SIZE" "$FRAMES" <<'PY'
import sys
from pathlib import Path
from tests.media import write_mp4, write_png
root, clips, frames = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
width, height = (int(n) for n in sys.argv[3].split("x"))
root.mkdir(parents=True, exist_ok=True)
for i in range(clips):
    path = root / (f"clip_{i}.mp4" if frames > 1 else f"image_{i}.png")
    if not path.exists():
        if frames > 1:
            write_mp4(path, width, height, frames, fps=16)
        else:
            write_png(path, width, height, color=(40 * i % 256, 90, 160))
        path.with_suffix(".txt").write_text(f"a sample number {i}")
if not (root.parent / "first_frame.png").exists():  # the validation prompt's, for image-to-video
    write_png(root.parent / "first_frame.png", width, height, color=(200, 120, 40))
PY
lap "media folder ready"
common=("$RECIPE" "finetune.pipeline=$WORK/$PIPE" "finetune.data.folder=$MEDIA"
    "finetune.data.cache_root=$WORK/cache" launch.nproc_per_node=1 global_batch_size=1)
case $PIPE in *i2v*) common+=("trainer.validation.conditions.image=[$WORK/first_frame.png]") ;; esac
common+=("${EXTRA_ARGS[@]}")
"${CLI[@]}" cache build "${common[@]}" --nproc 1
lap "cache built"
rm -rf "$WORK/results"
"${CLI[@]}" launch "${common[@]}" "results_dir=$WORK/results" \
    "max_steps=$STEPS" trainer.log_every=1 "trainer.sample_every=$STEPS" \
    "trainer.checkpoint_every=${CHECKPOINT_EVERY:-$STEPS}" "trainer.validation.steps=$SAMPLE_STEPS"
lap "trained $STEPS steps"
"${PY[@]}" - "$WORK/results" "${OUT:-}" <<'PY'
import json, shutil, statistics, sys
from pathlib import Path
results = Path(sys.argv[1])
records = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]
train = [r for r in records if "samples_per_s" in r]
later = train[len(train) // 2 : -1] or train[-1:]  # past warm-up, before the sampling step
rate = statistics.median(r["samples_per_s"] for r in later)
peak = max(r.get("peak_allocated_gib", 0.0) for r in records)
reserved = max(r.get("peak_reserved_gib", 0.0) for r in records)
samples = sorted(p for p in results.rglob("*") if p.suffix in (".mp4", ".png"))
print(f"samples/s (median of steps {later[0].get('step')}-{later[-1].get('step')}): {rate:.4f}")
print(f"peak allocated {peak:.2f} GiB, reserved {reserved:.2f} GiB")
print("samples:", [str(p.relative_to(results)) for p in samples])
if sys.argv[2]:
    for p in samples:
        shutil.copy(p, Path(sys.argv[2]) / p.name)
PY
