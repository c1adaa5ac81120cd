"""Real diffusers models through ``litegen launch`` and through a hand-written loop, one table.

For each model of ``litegen_zoo.real_models`` and each variant (eager; compiled: each transformer
block's ``forward`` compiled in place on both sides; tuned: compiled, with LiteGen's recommended
settings, :data:`TUNED`, on the launch side only; ``tuned-<x>``: the same without one of them,
with ``--launch-only`` an ablation; ``tuned-wan``: Wan's recommended settings), a recipe with
``real_model_entry.py`` is written to the work folder and run by ``launch_vs_hand.py``:
``litegen launch`` (1 rank) and ``hand_loop.py`` (a DataLoader over the same dataset, bf16
autocast, the same fused AdamW), each in its own process, alternating, ``--repeats`` times. A
side's samples/s is the median of its per-step rates over steps ``(--first, --last]`` (the best
repeat); launch logs every step (``trainer.log_every: 1``, which costs it no host sync), the
hand loop reads its loss every ``--hand-log-every`` steps as a user would and times each step
with CUDA events. Peak memory is ``torch.cuda.max_memory_allocated`` of each side's whole run
(launch: the largest peak of its log, since the trainer resets the peak at every log). Both
sides compile the same graphs, so the second reuses inductor's caches.

    python3 -m scripts.bench.bench_launch --out bench_launch.json                       # GPU
    python3 -m scripts.bench.bench_launch --models dit,wan --variants compiled --profile
    python3 -m scripts.bench.bench_launch --models wan --variants tuned-rows --launch-only \
        --launch-override optimization.compile.options.max_autotune_pointwise=true
    python -m scripts.bench.bench_launch --device cpu --tiny                            # CPU smoke run

``--profile`` traces three steps after the window on each side (torch.profiler) and prints
per step the wall time, GPU busy and idle time, and the host's time in synchronising calls
(``scripts/lab/step_profile.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from scripts.bench.launch_vs_hand import compare
from scripts.lab.step_profile import describe

ENTRY = Path(__file__).resolve().parent / "real_model_entry.py"
# Per model: global batch, dataset samples, and latent frames for video models (None: the
# zoo's reference shape). Wan at 11 frames of 60x104 latents: 11 * 30 * 52 = 17,160 tokens.
WORKLOADS: dict[str, dict[str, Any]] = {
    "dit": {"batch": 128, "samples": 256},  # DiT-XL/2, 256px
    "pixart": {"batch": 32, "samples": 64},  # PixArt-alpha, 512px, 120 T5 tokens
    "wan": {"batch": 1, "samples": 4, "frames": 11},  # Wan 2.1 1.3B
    "cogvideox": {"batch": 1, "samples": 4},  # CogVideoX-2B, 13 x 60 x 90 latents
    "ltx_video": {"batch": 2, "samples": 8},  # LTX-Video, 21 x 16 x 22 latents
}
TINY = {"batch": 4, "samples": 8}
# Variant "tuned": compiled on both sides, and LiteGen's recommended settings on the launch side
# only (bf16 parameters with FP32 masters, the experimental kernels, inductor's coordinate-descent
# tuning of its kernels); the hand side stays the plain compiled loop it is compared with.
TUNED = [
    "optimization.precision.preset=bf16-mixed",
    "optimization.experimental.persistent_rows=2048",
    "optimization.experimental.fused_gelu_mlp=true",
    "optimization.experimental.master_adamw=true",
    "optimization.compile.options.coordinate_descent_tuning=true",
]
# Launch-side settings of each variant; "tuned-<x>" variants leave one setting of TUNED out, so a
# run of them attributes the tuned gain (or cost) to each setting on a given model.
PRESET, ROWS, GELU, ADAMW, TUNING = TUNED
# Wan's own experimental kernel; "tuned-wan" is Wan's recommended settings: TUNED without the
# one-pass norms, which are slower on Wan, and with its fused self-attention.
WAN_ATTENTION = "optimization.experimental.fused_wan_attention=true"
VARIANTS: dict[str, list[str]] = {
    "eager": [],
    "compiled": [],
    "tuned": TUNED,
    "preset": [PRESET],
    **{
        f"tuned-{name}": [setting for setting in TUNED if setting != left_out]
        for name, left_out in (("rows", ROWS), ("gelu", GELU), ("adamw", ADAMW), ("tuning", TUNING))
    },
}
VARIANTS["tuned-wan"] = [*VARIANTS["tuned-rows"], WAN_ATTENTION]


def write_recipe(folder: Path, model: str, variant: str, args: argparse.Namespace) -> Path:
    """The recipe both sides run (its ``launch:`` section is read by the launch side only)."""
    cuda = args.device == "cuda"
    workload = TINY if args.tiny else WORKLOADS[model]
    settings = {
        "name": model,
        "size": "tiny" if args.tiny else "reference",
        "samples": workload["samples"],
    }
    if workload.get("frames"):
        settings["frames"] = workload["frames"]
    steps = args.last + 2
    if args.profile:
        settings["profile_steps"] = [args.last + 1, args.last + 4]
        steps = args.last + 5
    recipe = {
        "launch": {"entry": str(ENTRY), "nproc_per_node": 1},
        "exp_name": f"{model}_{variant}",
        "runtime": {
            "device": args.device,
            "distributed": {"backend": "nccl" if cuda else "gloo"},
        },
        "max_steps": steps,
        "global_batch_size": workload["batch"],
        "lr": 1e-4,
        "trainer": {"log_every": 1, "save_final": False, "autocast": "bf16" if cuda else None},
        "optimization": {"compile": {"enabled": variant != "eager"}},
        "model": settings,
    }
    path = folder / f"{model}_{variant}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def run(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    for model in args.models:
        for variant in args.variants:
            recipe = write_recipe(work, model, variant, args)
            results = compare(
                recipe,
                work / f"{model}_{variant}",
                first=args.first,
                last=args.last,
                window=1,
                rounds=args.repeats,
                side_overrides={
                    "hand": [f"trainer.log_every={args.hand_log_every}"],
                    "launch": [*VARIANTS[variant], *args.launch_override],
                },
                sides=("launch",) if args.launch_only else ("hand", "launch"),
            )
            row: dict[str, Any] = {"model": model, "variant": variant}
            for side, result in results.items():
                row[side] = result.best
                row[f"{side}_rates"] = result.rates
                memory = [s.get("peak_memory_gib") for s in result.summaries]
                row[f"{side}_peak_gib"] = max((m for m in memory if m is not None), default=None)
                profiles = [s["profile"] for s in result.summaries if s.get("profile")]
                if profiles:
                    row[f"{side}_profile"] = profiles[-1]
            row["ratio"] = row["launch"] / row["hand"] if "hand" in row else None
            rows.append(row)
            print_row(row, header=len(rows) == 1)
    return rows


def _gib(value: float | None) -> str:
    return f"{value:8.2f}" if value is not None else f"{'-':>8}"


def _num(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print(
            f"{'model':<10} {'variant':<11} {'hand/s':>10} {'launch/s':>10} {'ratio':>7} "
            f"{'hand GiB':>8} {'launch GiB':>10}"
        )
    print(
        f"{row['model']:<10} {row['variant']:<11} {_num(row.get('hand'), 10, 2)} "
        f"{row['launch']:10.2f} {_num(row['ratio'], 7, 3)} {_gib(row.get('hand_peak_gib'))} "
        f"{_gib(row['launch_peak_gib']):>10}",
        flush=True,
    )
    for side in ("hand", "launch"):
        if f"{side}_profile" in row:
            print(f"    profile {side}: {describe(row[f'{side}_profile'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="dit,pixart,wan,cogvideox")
    parser.add_argument("--variants", default="eager,compiled", help=", ".join(VARIANTS))
    parser.add_argument("--launch-only", action="store_true", help="no hand side (ablations)")
    parser.add_argument(
        "--launch-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the launch side, after the variant's (repeatable)",
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny configs, 3 steps, eager")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating")
    parser.add_argument("--first", type=int, default=10, help="steps left out as warm-up")
    parser.add_argument("--last", type=int, default=30, help="last step of the timed window")
    parser.add_argument("--hand-log-every", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--work", type=Path, default=None, help="kept; default a temporary one")
    parser.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    args = parser.parse_args()
    args.models = args.models.split(",")
    args.variants = args.variants.split(",")
    unknown_variants = sorted(set(args.variants) - set(VARIANTS))
    if unknown_variants:
        parser.error(f"unknown variants {unknown_variants}; choose from {list(VARIANTS)}")
    unknown = sorted(set(args.models) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(WORKLOADS)}")
    if args.tiny:
        args.variants, args.first, args.last = ["eager"], 1, 2
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        rows = run(args, work)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    if ratios:
        print(f"median launch / hand: {statistics.median(ratios):.3f}")
    if args.out is not None:
        import diffusers
        import torch

        versions = {"torch": torch.__version__, "diffusers": diffusers.__version__}
        args.out.write_text(json.dumps({"argv": sys.argv[1:], **versions, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
