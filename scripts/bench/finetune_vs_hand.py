"""A fine-tuning recipe through ``litegen launch`` against the hand-written peft LoRA loop
(``hand_lora_loop.py``), the same work on one GPU, sides alternating; prints one table.

It prepares what the recipe needs under ``--work`` (kept and reused by the next call): a
pipeline folder with the real transformer's shapes and random weights (Wan 2.1 1.3B, or a
Flux.1-dev-wide transformer of ``--flux-layers``/``--flux-single-layers`` blocks), a media
folder of clips or images at exactly the bucket the recipe trains at, and the cache
(``litegen cache build``). Then it runs each side of ``--sides`` in its own process, in
alternating order over ``--rounds`` rounds, appends each run to ``<work>/runs.jsonl``, and
prints the table of every run of this shape found there (so two calls of one round each give
two rounds): side, samples/s of each round, their median, peak GiB, and the ratio to
``--reference``.

Sides: ``hand`` (eager), ``hand-compiled`` (each block ``torch.compile``'d), ``launch`` (the
recipe as shipped), ``launch-compiled`` (``optimization.compile.enabled=true``, ``dynamic:
null``), ``launch-recommended`` (and the fused optimizer), ``launch-tuned`` (and inductor's
``coordinate_descent_tuning``), ``launch-tuned-wan`` (and ``fused_wan_attention``) and
``launch-lab-wan`` (and ``fused_gelu_mlp``: docs/performance.md's recommended fine-tuning
settings on Wan).

On a GPU node without uv, from the repository root (docs in /work/shared/gpu/README.md)::

    PYTHONPATH=/tmp/site:$PWD/litegen_core/src:$PWD/litegen_cli/src:$PWD \\
      python3 -m scripts.bench.finetune_vs_hand --family wan --recipe recipes/finetune_video.yaml

Reduced shape (``.ci/gpu_smoke.sh``): ``--resolution 256 --frames 17 --windows 1``.

Where each side's time goes: ``--profile 31,34`` traces those steps with torch.profiler (the
launch sides through the ``scripts.lab.profiled_finetune`` entry) and writes ``profile.json`` and
``profile_trace.json.gz`` to each run's folder; ``python -m scripts.lab.trace_kernels
RUN/.../profile_trace.json.gz --steps 3`` names the kernels. Profiled runs are tabled apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HAND = Path(__file__).resolve().parent / "hand_lora_loop.py"

# Extra overrides of each litegen side (on top of the recipe and the shared ones below).
_RECOMMENDED = [
    "optimization.compile.enabled=true",
    "optimization.compile.dynamic=null",
    "optimization.optimizer.backend=fused",
]
_TUNED = [*_RECOMMENDED, "optimization.compile.options.coordinate_descent_tuning=true"]
_TUNED_WAN = [*_TUNED, "optimization.experimental.fused_wan_attention=true"]
LAUNCH_SIDES: dict[str, list[str]] = {
    "launch": [],
    "launch-compiled": ["optimization.compile.enabled=true", "optimization.compile.dynamic=null"],
    "launch-recommended": _RECOMMENDED,
    # Tuned Triton launches (longer cold compiles) and, on Wan, the fused self-attention (one
    # GEMM each way for the projections and for their adapters, the query/key norm and rotary
    # embedding in one kernel) and the GELU MLP with its activation in the GEMMs' epilogues.
    "launch-tuned": _TUNED,
    "launch-tuned-wan": _TUNED_WAN,
    "launch-lab-wan": [*_TUNED_WAN, "optimization.experimental.fused_gelu_mlp=true"],
}
HAND_SIDES: dict[str, list[str]] = {"hand": [], "hand-compiled": ["--compile"]}


# -- what the driver assumes about the recipe: adapt here when its keys or entry move --------
def recipe_overrides(args: argparse.Namespace, pipeline: Path, media: Path) -> list[str]:
    """The recipe keys naming the pipeline folder, the media, the cache and the bucket size."""
    return [
        f"finetune.pipeline={pipeline}",
        f"finetune.data.folder={media}",
        f"finetune.data.cache_root={args.work / 'cache'}",
        f"finetune.data.resolution={args.resolution}",
        f"finetune.data.max_frames={args.frames}",
        "global_batch_size=1",  # the recipe's batch is checked against the media at build too
        *args.recipe_override,
    ]


def run_overrides(args: argparse.Namespace, results: Path) -> list[str]:
    """One GPU, batch 1, a fixed number of steps, logging once per timed window, no sampling
    and no checkpoint (neither is timed, both take minutes at real size)."""
    return [
        "launch.nproc_per_node=1",
        "global_batch_size=1",
        f"max_steps={args.warmup + args.window * args.windows}",
        f"trainer.log_every={args.window}",
        "trainer.sample_every=0",
        "trainer.checkpoint_every=0",
        "trainer.save_final=false",
        f"optimization.lora.rank={args.rank}",
        f"optimization.lora.alpha={args.alpha}",
        f"results_dir={results}",
    ]


# -- preparation -------------------------------------------------------------------------------
def bucket(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(frames, height, width)`` the recipe trains a file of ``--aspect`` at (the family's
    rule)."""
    from litegen.data import MediaBuckets
    from litegen.data.media_files import MediaFile

    frames = args.frames
    wide, high = (int(n) for n in args.aspect.split(":"))
    rule = MediaBuckets(resolution=args.resolution, spatial_multiple=16, max_frames=frames)
    file = MediaFile(Path("x"), "", 64 * wide, 64 * high, frames=frames, is_video=frames > 1)
    return rule.bucket(file)


def make_pipeline(args: argparse.Namespace, folder: Path) -> None:
    """The pipeline folder, transformer stored in bf16 (built on the GPU: seconds, not minutes)."""
    from litegen_zoo.make_tiny_pipeline import make_tiny_pipeline
    from litegen_zoo.real_size_pipelines import flux_dev_pipeline, wan_1_3b_pipeline

    if args.tiny:
        make_tiny_pipeline(args.family, folder)
    elif args.family == "wan":
        wan_1_3b_pipeline().save_pretrained(str(folder))
    else:
        flux_dev_pipeline(
            layers=args.flux_layers, single_layers=args.flux_single_layers
        ).save_pretrained(str(folder))


def make_media(args: argparse.Namespace, folder: Path, shape: tuple[int, int, int]) -> None:
    from tests.media import write_mp4, write_png

    frames, height, width = shape
    for i in range(args.clips):
        if args.family == "wan":
            write_mp4(folder / f"clip_{i}.mp4", width, height, frames, fps=16)
        else:
            write_png(folder / f"image_{i}.png", width, height, color=(40 * i % 256, 90, 160))
        (
            folder / f"clip_{i}.txt" if args.family == "wan" else folder / f"image_{i}.txt"
        ).write_text(f"a sample number {i}")


def cli(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "litegen_cli.app", *arguments]


def make_inputs(args: argparse.Namespace) -> tuple[Path, Path, tuple[int, int, int]]:
    """The pipeline, media and cache under ``--work``; each is made once."""
    shape = bucket(args)
    suffix = "" if args.family == "wan" else f"-{args.flux_layers}x{args.flux_single_layers}"
    suffix += "-tiny" if args.tiny else ""
    pipeline = args.work / f"{args.family}{suffix}-pipeline"
    if not (pipeline / "model_index.json").is_file():
        shutil.rmtree(pipeline, ignore_errors=True)
        lap(f"writing the pipeline folder {pipeline}")
        make_pipeline(args, pipeline)
    media = args.work / f"media-{args.family}-{'x'.join(map(str, shape))}"
    if not media.is_dir():
        lap(f"writing {args.clips} media files of {shape} (frames, height, width)")
        media.mkdir(parents=True)
        make_media(args, media, shape)
    lap("building the cache (litegen cache build)")
    build = cli(
        "cache",
        "build",
        str(args.recipe),
        *recipe_overrides(args, pipeline, media),
        "launch.nproc_per_node=1",
        "--nproc",
        "1",
    )
    run_logged(build, args.work / "cache_build.log", args.timeout)
    return pipeline, media, shape


# -- the runs --------------------------------------------------------------------------------
_START = time.time()


def lap(message: str) -> None:
    print(f"[{time.time() - _START:6.0f} s] {message}", flush=True)


def run_logged(command: list[str], log: Path, timeout: float) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=ROOT
        )
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(command)}\n{tail}")


def text_tokens(args: argparse.Namespace, pipeline: Path) -> int:
    """The text length the recipe caches: the (T5) tokenizer's, at most 512."""
    name = "tokenizer" if args.family == "wan" else "tokenizer_2"
    config = json.loads((pipeline / name / "tokenizer_config.json").read_text())
    return min(int(config.get("model_max_length", 512)), 512)


def run_hand(args, side: str, pipeline: Path, shape, folder: Path) -> dict[str, Any]:
    frames, height, width = shape
    out = folder / "hand.json"
    options = {
        "pipeline": pipeline,
        "family": args.family,
        "frames": frames,
        "height": height,
        "width": width,
        "text-tokens": text_tokens(args, pipeline),
        "rank": args.rank,
        "alpha": args.alpha,
        "warmup": args.warmup,
        "window": args.window,
        "windows": args.windows,
        "out": out,
    }
    flags = [item for name, value in options.items() for item in (f"--{name}", str(value))]
    command = [sys.executable, str(HAND), *flags, *HAND_SIDES[side]]
    if args.attention:
        command += ["--attention", args.attention]
    if args.profile:
        command += ["--profile", args.profile]
    run_logged(command, folder / "run.log", args.timeout)
    result = json.loads(out.read_text())
    return {
        "samples_per_s": result["samples_per_s"],
        "peak_gib": result["peak_gib"],
        "tokens": result["tokens"],
    }


def run_launch(args, side: str, pipeline: Path, media: Path, folder: Path) -> dict[str, Any]:
    results = folder / "results"
    command = cli(
        "launch",
        str(args.recipe),
        *recipe_overrides(args, pipeline, media),
        *run_overrides(args, results),
        *args.launch_sides[side],
        *args.launch_override,
        *([f"optimization.kernels.attention_backend={args.attention}"] if args.attention else []),
        *(["launch.entry=scripts.lab.profiled_finetune"] if args.profile else []),
    )
    run_logged(command, folder / "run.log", args.timeout)
    lines = (results / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    timed = [r for r in records if r.get("samples_per_s") and r["step"] > args.warmup]
    if not timed:
        raise RuntimeError(f"{side}: no record past step {args.warmup} in {results}")
    peaks = [r["peak_allocated_gib"] for r in records if r.get("peak_allocated_gib") is not None]
    return {
        "samples_per_s": statistics.median(r["samples_per_s"] for r in timed),
        "peak_gib": max(peaks) if peaks else None,
    }


def shape_key(args: argparse.Namespace, shape) -> str:
    flux = f" {args.flux_layers}+{args.flux_single_layers} blocks" if args.family == "flux" else ""
    profiled = " profiled" if args.profile else ""  # the profiler slows both sides
    shape = "x".join(map(str, shape))
    return f"{args.family}{flux} {shape} rank {args.rank} {args.recipe.name}{profiled}"


def summary(args: argparse.Namespace, key: str) -> dict[str, Any]:
    """Every run of this shape in ``runs.jsonl``, by side: rates, median, peak, ratio."""
    runs = [json.loads(line) for line in (args.work / "runs.jsonl").read_text().splitlines()]
    runs = [r for r in runs if r["shape"] == key]
    by_side: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_side.setdefault(run["side"], []).append(run)
    sides = {}
    for side, side_runs in by_side.items():
        peaks = [r["peak_gib"] for r in side_runs if r["peak_gib"] is not None]
        sides[side] = {
            "samples_per_s": [r["samples_per_s"] for r in side_runs],
            "median": statistics.median(r["samples_per_s"] for r in side_runs),
            "peak_gib": max(peaks) if peaks else None,
        }
    reference = sides.get(args.reference, {}).get("median")
    for row in sides.values():
        row["ratio"] = row["median"] / reference if reference else None
    last = runs[-1]
    return {
        "shape": key,
        "device": last["device"],
        "torch": last["torch"],
        "reference": args.reference,
        "sides": sides,
    }


def table(result: dict[str, Any]) -> str:
    """The summary as the table printed last."""
    lines = [
        f"{result['shape']}; {result['device']}, torch {result['torch']}",
        f"{'side':<20} {'samples/s (rounds)':<24} {'median':>8} {'peak GiB':>9} {'ratio':>6}",
    ]
    for side, row in result["sides"].items():
        rates = " ".join(f"{rate:.3f}" for rate in row["samples_per_s"])
        peak = f"{row['peak_gib']:9.1f}" if row["peak_gib"] is not None else f"{'-':>9}"
        ratio = f"{row['ratio']:6.3f}" if row["ratio"] is not None else f"{'-':>6}"
        lines.append(f"{side:<20} {rates:<24} {row['median']:8.3f} {peak} {ratio}")
    lines.append(f"ratio: median samples/s over {result['reference']}'s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    pipeline, media, shape = make_inputs(args)
    key = shape_key(args, shape)
    log = args.work / "runs.jsonl"
    done = (
        sum(1 for line in log.read_text().splitlines() if json.loads(line)["shape"] == key)
        if log.is_file()
        else 0
    )
    failed = []
    for round_ in range(args.rounds):
        # Alternate the order, continuing from the runs of earlier calls.
        order = args.sides if (done // len(args.sides) + round_) % 2 == 0 else args.sides[::-1]
        for side in order:
            folder = args.work / "runs" / f"{side}-{int(time.time())}"
            shutil.rmtree(folder, ignore_errors=True)
            lap(f"{side}: running (log {folder / 'run.log'})")
            try:
                if side in HAND_SIDES:
                    result = run_hand(args, side, pipeline, shape, folder)
                else:
                    result = run_launch(args, side, pipeline, media, folder)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                # The other sides still run and the table still prints; the exit code says.
                lap(f"{side}: FAILED: {exc}")
                failed.append(side)
                continue
            result.update(side=side, shape=key, device=device, torch=torch.__version__)
            with log.open("a") as out:
                out.write(json.dumps(result) + "\n")
            lap(f"{side}: {result['samples_per_s']:.3f} samples/s, peak {result['peak_gib']}")
    if log.is_file() and any(json.loads(line)["shape"] == key for line in log.open()):
        result = summary(args, key)
        if args.summary is not None:
            args.summary.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(table(result))
    if failed:
        print(f"failed: {' '.join(failed)} (their logs are under {args.work / 'runs'})")
        sys.exit(1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("wan", "flux"), default="wan")
    parser.add_argument(
        "--recipe",
        type=Path,
        default=None,
        help="default: recipes/finetune_video.yaml (wan), finetune_image.yaml",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/finetune_vs_hand"))
    parser.add_argument(
        "--resolution", type=int, default=None, help="480 (wan), 1024 (flux), 64 (--tiny)"
    )
    parser.add_argument("--aspect", default=None, help="width:height, 16:9 (wan), 1:1 (flux)")
    parser.add_argument("--tiny", action="store_true", help="the tiny zoo pipeline (CPU check)")
    parser.add_argument("--frames", type=int, default=49, help="Wan: frames of a clip, 4k+1")
    parser.add_argument("--rank", type=int, default=None, help="the recipe's: 32 wan, 16 flux")
    parser.add_argument("--flux-layers", type=int, default=8, help="double-stream blocks (dev: 19)")
    parser.add_argument("--flux-single-layers", type=int, default=16, help="(dev: 38)")
    parser.add_argument("--clips", type=int, default=2, help="media files")
    parser.add_argument(
        "--sides",
        nargs="+",
        default=["hand-compiled", "launch", "launch-compiled"],
        help=f"of {[*HAND_SIDES, *LAUNCH_SIDES]} and those --side-def defines",
    )
    parser.add_argument(
        "--side-def",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "KEY=VALUE"),
        help="a launch side of your own: its name and overrides (an ablation, say)",
    )
    parser.add_argument("--reference", default="hand-compiled")
    parser.add_argument("--summary", type=Path, help="also write the table as JSON here")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--attention",
        choices=("cudnn", "flash", "efficient"),
        default=None,
        help="one SDPA kernel for both sides (default: each side's own choice)",
    )
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timed windows")
    parser.add_argument("--window", type=int, default=10, help="steps per timed window")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=480, help="seconds per run")
    parser.add_argument(
        "--profile", metavar="FIRST,LAST", help="trace steps [FIRST, LAST) of every side"
    )
    parser.add_argument(
        "--recipe-override",
        nargs="*",
        default=[],
        help="KEY=VALUE for cache build and launch (e.g. launch.entry=...)",
    )
    parser.add_argument(
        "--launch-override", nargs="*", default=[], help="KEY=VALUE for every launch side"
    )
    args = parser.parse_args(argv)
    args.launch_sides = {**LAUNCH_SIDES, **{d[0]: d[1:] for d in args.side_def}}
    unknown = [s for s in args.sides if s not in HAND_SIDES and s not in args.launch_sides]
    if unknown:
        parser.error(f"unknown sides {unknown}; define them with --side-def NAME KEY=VALUE ...")
    wan = args.family == "wan"
    if args.recipe is None:
        args.recipe = ROOT / "recipes" / ("finetune_video.yaml" if wan else "finetune_image.yaml")
    # The tiny pipeline's rotary table covers small latents only.
    args.resolution = args.resolution or (64 if args.tiny else 480 if wan else 1024)
    args.frames = args.frames if wan else 1
    args.aspect = args.aspect or ("16:9" if wan else "1:1")
    args.rank = args.rank or (32 if wan else 16)
    args.alpha = float(args.rank)  # both recipes: alpha = rank
    if args.profile:
        first, last = (int(n) for n in args.profile.split(","))
        if not 0 < first < last <= args.warmup + args.window * args.windows:
            parser.error(f"--profile {args.profile}: steps out of the run's range")
        os.environ["LITEGEN_PROFILE_STEPS"] = args.profile  # the profiled entry reads it
    return args


if __name__ == "__main__":
    main()
