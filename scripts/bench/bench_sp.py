"""Sequence parallelism on Wan 2.1 1.3B: the longest trainable video and tokens/s/GPU per
layout, Ulysses ``sp`` x ring ``cp``.

Every cell is one ``litegen launch`` of ``sp_dry_run.yaml`` (the entry ``real_model_entry.py``,
random weights, synthetic latents) with fsdp2 over the data-parallel dimension, Ulysses over
``sp`` ranks and ring attention over ``cp``, one sample per group (so ``nproc_per_node = sp x
cp``), bf16 autocast, blocks compiled. A layout is ``4`` (Ulysses alone) or ``4x2``. Memory settings: ``none`` (no checkpointing), ``full`` (every block checkpointed),
``offload`` (every block checkpointed, activations offloaded).

- Longest: latent frames of 60 x 104 (480p; ``--height/--width`` for 720p: 90 x 160) grow by
  doubling from ``--start-frames`` until a step runs out of memory, then bisect to
  ``--frame-step``; each probe is a launch of two steps.
- Throughput: tokens/s/GPU and MFU, median of the logged steps after ``--warmup``, at 21 frames
  of 480p (32,760 tokens) and of 720p (75,600 tokens), for each memory setting (``-`` where it
  does not fit).

    python3 -m scripts.bench.bench_sp --sp 1,2,4,8 --out sp_grid.json                     # 8 GPUs
    python3 -m scripts.bench.bench_sp --sp 2,1x2,4,2x2,1x4,4x2,2x4,1x8 --memory full,offload \
        --out cp_grid.json                              # 8 GPUs: Ulysses, ring and both, 2 to 8
    python3 -m scripts.bench.bench_sp --sp 1 --memory full --skip-longest                  # 1 GPU
    uv run --locked python -m scripts.bench.bench_sp --device cpu --tiny --sp 1,2 --max-frames 8

``--device cpu --tiny`` is the dry run: a tiny Wan on gloo ranks, where nothing runs out of
memory, so the search stops at ``--max-frames``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from scripts.bench.length_search import longest

HERE = Path(__file__).resolve().parent
RECIPE = HERE / "sp_dry_run.yaml"
MEMORY = {
    "none": ["optimization.memory.activation_checkpoint.enabled=false"],
    "full": ["optimization.memory.activation_checkpoint.selective_ratio=0.0"],
    "offload": [
        "optimization.memory.activation_checkpoint.selective_ratio=0.0",
        "optimization.memory.activation_offload=true",
    ],
}
SHAPES = {"480p": (60, 104), "720p": (90, 160)}  # latent height, width (VAE factor 8)
THROUGHPUT_FRAMES = 21  # 81 video frames: 21 x 30 x 52 = 32,760 tokens at 480p, 75,600 at 720p


class Launcher:
    """Runs one cell of the grid as ``litegen launch`` and reads back its metrics."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work, self.runs = args, work, 0

    def overrides(
        self, layout: tuple[int, int], memory: str, frames: int, shape: tuple[int, int]
    ) -> list[str]:
        args = self.args
        cuda = args.device == "cuda"
        height, width = shape
        sp, cp = layout
        return [
            f"runtime.device={args.device}",
            f"runtime.distributed.backend={'nccl' if cuda else 'gloo'}",
            f"launch.nproc_per_node={sp * cp}",
            f"optimization.parallel.sp_size={sp}",
            f"optimization.parallel.cp_size={cp}",
            "global_batch_size=1",
            f"model.size={'tiny' if args.tiny else 'reference'}",
            f"model.frames={frames}",
            f"model.height={height}",
            f"model.width={width}",
            f"model.text_tokens={6 if args.tiny else 512}",
            "model.samples=2",
            f"optimization.compile.enabled={str(cuda).lower()}",
            f"trainer.autocast={'bf16' if cuda else 'null'}",
            *MEMORY[memory],
        ]

    def run(self, overrides: list[str], steps: int) -> tuple[bool, list[dict[str, Any]], str]:
        self.runs += 1
        results = self.work / f"run{self.runs}"
        command = [
            sys.executable, "-m", "litegen_cli.app", "launch", str(RECIPE), *overrides,
            f"max_steps={steps}", "trainer.log_every=1", f"results_dir={results}",
        ]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=self.args.timeout)
        output = proc.stdout + proc.stderr
        metrics = results / "metrics.jsonl"
        records = []
        if metrics.is_file():
            lines = metrics.read_text(encoding="utf-8").splitlines()
            records = [json.loads(line) for line in lines if line.strip()]
        if proc.returncode != 0 and "out of memory" not in output.lower():
            print(f"   launch failed (exit {proc.returncode}): {output.strip()[-600:]}")
        return proc.returncode == 0, records, output


def latent_shape(args: argparse.Namespace, name: str) -> tuple[int, int]:
    """Latent height and width of ``name`` (480p, 720p); 4 x 4 for the tiny dry run."""
    return (4, 4) if args.tiny else SHAPES[name]


def tokens(frames: int, shape: tuple[int, int]) -> int:
    """Wan's patch is 1 x 2 x 2: a frame of h x w latents is h/2 x w/2 tokens."""
    return frames * (shape[0] // 2) * (shape[1] // 2)


def throughput(records: list[dict[str, Any]], warmup: int, gpus: int) -> dict[str, float | None]:
    """Median tokens/s/GPU and MFU over the records after ``warmup`` steps."""
    kept = [r for r in records if r["step"] > warmup and r.get("tokens_per_s")]
    if not kept:
        return {"tokens_per_s_per_gpu": None, "mfu": None}
    mfu = [r["mfu"] for r in kept if r.get("mfu") is not None]
    return {
        "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s"] for r in kept) / gpus,
        "mfu": statistics.median(mfu) if mfu else None,
    }


def run_grid(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    launcher = Launcher(args, work)
    rows = []
    for layout in args.sp:
        for memory in args.memory:
            label = f"{layout[0]}x{layout[1]}" if layout[1] > 1 else str(layout[0])
            row: dict[str, Any] = {"sp": label, "memory": memory}
            if not args.skip_longest:
                shape = latent_shape(args, args.longest_shape)

                def fits(frames: int, layout=layout, memory=memory, shape=shape) -> bool:
                    ok, _, _ = launcher.run(launcher.overrides(layout, memory, frames, shape), 2)
                    print(
                        f"   sp={layout[0]} cp={layout[1]} {memory}: {frames} frames "
                        f"{'fits' if ok else 'no'}"
                    )
                    return ok

                frames = longest(fits, args.start_frames, args.frame_step, args.max_frames)
                row.update(longest_frames=frames, longest_tokens=tokens(frames, shape))
            for name in args.throughput:
                shape = latent_shape(args, name)
                frames = 3 if args.tiny else THROUGHPUT_FRAMES
                overrides = launcher.overrides(layout, memory, frames, shape)
                ok, records, _ = launcher.run(overrides, args.warmup + args.steps)
                figures = throughput(records, args.warmup, layout[0] * layout[1]) if ok else {}
                row[f"{name}_tokens"] = tokens(frames, shape)
                row[f"{name}_tokens_per_s_per_gpu"] = figures.get("tokens_per_s_per_gpu")
                row[f"{name}_mfu"] = figures.get("mfu")
            rows.append(row)
            print_row(row, header=len(rows) == 1, args=args)
    return rows


def _cell(value: Any, width: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, float):
        return f"{value:>{width},.1f}" if value >= 1 else f"{value:>{width}.3f}"
    return f"{value:>{width},}" if isinstance(value, int) else f"{value:>{width}}"


def print_row(row: dict[str, Any], header: bool, args: argparse.Namespace) -> None:
    columns = ["sp", "memory"]
    if not args.skip_longest:
        columns += ["longest_frames", "longest_tokens"]
    for name in args.throughput:
        columns += [f"{name}_tokens_per_s_per_gpu", f"{name}_mfu"]
    if header:
        print(" ".join(f"{c:>{max(8, len(c))}}" for c in columns))
    print(" ".join(_cell(row.get(c), max(8, len(c))) for c in columns), flush=True)


def parse_layout(text: str) -> tuple[int, int]:
    """``"4"`` -> ``(4, 1)``, ``"4x2"`` -> ``(4, 2)``: Ulysses size, ring size."""
    sp, _, cp = text.partition("x")
    return int(sp), int(cp or 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sp", default="1,2,4,8", help="layouts: sp (Ulysses, a divisor of 12) or SPxCP (ring)"
    )
    parser.add_argument("--memory", default="none,full,offload", help=", ".join(MEMORY))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny Wan (CPU dry run)")
    parser.add_argument("--skip-longest", action="store_true")
    parser.add_argument("--longest-shape", default="480p", choices=list(SHAPES))
    parser.add_argument("--start-frames", type=int, default=8)
    parser.add_argument("--frame-step", type=int, default=4)
    parser.add_argument("--max-frames", type=int, default=512)
    parser.add_argument("--throughput", default="480p,720p", help="shapes at 21 frames, or ''")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--work", type=Path, default=None, help="kept; default a temporary one")
    parser.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    args = parser.parse_args()
    args.sp = [parse_layout(s) for s in args.sp.split(",")]
    args.memory = [m for m in args.memory.split(",") if m]
    args.throughput = [t for t in args.throughput.split(",") if t]
    for name in [*args.memory, *args.throughput]:
        if name not in MEMORY and name not in SHAPES:
            parser.error(
                f"unknown setting {name!r}; memory: {list(MEMORY)}, shapes: {list(SHAPES)}"
            )
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        rows = run_grid(args, work)
    if args.out is not None:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
