"""Step time and peak memory of checkpointing and offload on Wan 2.1 1.3B, and its longest sequence.

The model is diffusers' ``WanTransformer3DModel`` at its published config with random weights
(``litegen_zoo/real_models.py``), trained with a flow-matching loss at batch 1 under bf16 autocast,
AdamW (fused), blocks compiled regionally. Latents are 16 x F x 60 x 104 with patch (1, 2, 2),
so F frames make F x 1560 tokens (11 frames: 17,160), with 512 text tokens of width 4096.

The variants and what one process measures are in ``wan_memory_runs.py``.

Table (default): every variant runs in a process of its own (``--rounds`` > 1 alternates their
order: forward, then backward), 3 warm-up steps and 6 timed ones; the step time is their median,
the peak is ``max_memory_allocated`` over the timed steps. Variants:

    hand_none            hand-written: torch.compile(block.forward) on every block
    hand_ckpt            hand-written: checkpoint_wrapper(compiled block) on every block
    full                 LiteGen, selective_ratio 0 (checkpoint inside the compiled block)
    full_outside         LiteGen, selective_ratio 0, inside_compile false
    ops, ops_all         LiteGen, selective_ratio 0 with policy ops / ops_all
    half                 LiteGen, selective_ratio 0.5
    half_offload         half + activation_offload (every block but the last)
    half_offload_inputs  half, offloading only the checkpointed blocks' inputs (offload's old scope)
    full_offload         full + activation_offload
    auto                 selective_ratio auto within --auto-budget-gib, offload allowed

``--longest`` searches the most frames one training step fits, for no checkpointing, full
checkpointing, and full checkpointing + offload: a peak measured at a few frames (the table's,
this run's or ``--seed-from`` an earlier one's, else a seed probe's) predicts the limit with
memory linear in frames; each probe that fits corrects the line (a secant through the two
longest fits), and once one fails the search bisects to ``--frame-step`` frames (finer for
short limits; out of memory = too long). Each probe runs in its own process. ``--memory-limit-gib``
caps what each probe may allocate (``torch.cuda.set_per_process_memory_fraction``), emulating a
smaller device so that probes stay short; the ratio between the three is what the search shows.
Probes compile with dynamic shapes, so every length after the first reuses the compile caches.
Variants with offload run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless it is
set, as ``litegen launch`` runs them.
``--mlp-chunk-tokens N`` runs every LiteGen variant with ``optimization.memory.mlp_chunk_tokens``
(the MLPs recompute their hidden activation N tokens at a time; hand-written variants unchanged).

    python3 -m scripts.bench.bench_memory_real --out wan_table.json
    python3 -m scripts.bench.bench_memory_real --longest --variants --seed-from wan_table.json \\
        --memory-limit-gib 32 --probes 3 --out wan_longest.json
    uv run --no-sync python -m scripts.bench.bench_memory_real --device cpu --tiny --longest  # smoke

``--probe VARIANT@FRAMES`` runs single probes (fits or not, and the peak) instead of a search,
for limits whose probes are too slow to search. ``--precision bf16-mixed`` trains every variant
as LiteGen's preset of that name does: bf16 parameters and gradients, FP32 masters in AdamW.
``--time-budget-s`` stops starting new processes past that many seconds and writes what it has.

    python3 -m scripts.bench.bench_memory_real --variants --precision bf16-mixed --memory-limit-gib 48 \\
        --probe full@96 full_offload@144
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench.wan_memory_runs import LONGEST, TABLE, VARIANTS, Variant, probe, time_variant

ROOT = Path(__file__).resolve().parents[2]  # the children run as modules from here
RESULT = "RESULT "  # a child's last stdout line: RESULT {json}


# -- the parent: processes, table, search ------------------------------------------------------
def _child_env(variant: Variant) -> dict[str, str]:
    """The environment ``litegen launch`` would give ``variant``'s ranks (allocator setting)."""
    from litegen_cli.launcher import ALLOCATOR_ENV, OFFLOAD_ALLOCATOR_CONF

    env = dict(os.environ)
    if variant.memory.get("activation_offload") or variant.offload_inputs_only:
        env.setdefault(ALLOCATOR_ENV, OFFLOAD_ALLOCATOR_CONF)
    return env


class Runner:
    """Starts one child process per measurement, within a time budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.perf_counter()

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.args.time_budget_s

    def child(self, mode: str, variant: str, frames: int) -> dict[str, Any]:
        a = self.args
        opts = {
            "mode": mode,
            "variant": variant,
            "frames": frames,
            "device": a.device,
            "tiny": a.tiny,
            "backend": a.backend,
            "dynamic": mode == "probe",  # probes share compiles across lengths
            "warmup": a.warmup,
            "steps": a.steps,
            "memory_limit_gib": a.memory_limit_gib,
            "auto_budget_gib": a.auto_budget_gib,
            "blocks_in_flight": a.offload_blocks_in_flight,
            "precision": a.precision,
            "mlp_chunk_tokens": a.mlp_chunk_tokens,
        }
        module = "scripts.bench.bench_memory_real"
        command = [sys.executable, "-m", module, "--child", json.dumps(opts)]
        print(f"[{time.perf_counter() - self.start:6.0f} s] {mode} {variant} @ {frames} frames")
        sys.stdout.flush()
        try:
            proc = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=a.child_timeout_s,
                cwd=ROOT,
                env=_child_env(VARIANTS[variant]),
            )
        except subprocess.TimeoutExpired:
            return {"variant": variant, "frames": frames, "fits": False, "reason": "timeout"}
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
        if lines:
            return json.loads(lines[-1][len(RESULT) :])
        output = (proc.stderr or proc.stdout).strip().splitlines()
        errors = [line for line in output if "Error" in line or "error:" in line]
        tail = errors[-2:] + output[-3:]  # the exception's own line, then where it ended
        print("   child failed:", *tail, sep="\n     ")
        return {"variant": variant, "frames": frames, "fits": False, "reason": " | ".join(tail)}


def run_table(runner: Runner, variants: list[str], frames: int) -> list[dict[str, Any]]:
    """Each variant ``--rounds`` times, the order reversed every other round."""
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_ in range(runner.args.rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            if runner.out_of_time():
                print("time budget reached; the table is partial")
                break
            row = runner.child("time", variant, frames)
            if "step_s" in row:
                results[variant].append(row)
    rows = []
    for runs in results.values():
        if not runs:
            continue
        row = dict(runs[-1])
        row["step_s"] = statistics.median(r["step_s"] for r in runs)
        if runs[0].get("peak_gib") is not None:
            row["peak_gib"] = max(r["peak_gib"] for r in runs)
        row["rounds"] = len(runs)
        rows.append(row)
    reference = next((r for r in rows if r["variant"] == "hand_none"), None)
    for row in rows:
        row["label"] = VARIANTS[row["variant"]].label
        row["samples_per_s"] = 1.0 / row["step_s"]  # batch 1
        row["time_x"] = row["step_s"] / reference["step_s"] if reference else None
    return rows


def _predict(points: list[tuple[int, float]], resident: float, limit: float) -> int:
    """Frames at which the peak reaches ``limit``: a line through the two longest fits.

    With one fit the line goes through the memory resident before the step (0 frames). The
    peak is only piecewise linear in frames (which phase of the step sets it changes with
    length), so each new fit corrects the line: a secant search.
    """
    (f0, p0), (f1, p1) = [(0, resident), *sorted(points)][-2:]
    per_frame = (p1 - p0) / (f1 - f0)
    return int(f1 + (limit - p1) / per_frame) if per_frame > 0 else f1


def longest(runner: Runner, variant: str, seed: dict[str, Any] | None) -> dict[str, Any]:
    """The most frames (a multiple of ``--frame-step``) one step of ``variant`` fits."""
    a = runner.args
    probes: list[dict[str, Any]] = []
    lo, hi = 0, None
    if seed is None or seed.get("peak_gib") is None:  # no table row to predict from (or cpu)
        seed = runner.child("probe", variant, a.seed_frames)
        probes.append(seed)
    limit = a.memory_limit_gib or seed.get("total_gib")
    if seed.get("fits") and (seed.get("peak_gib") is None or seed["peak_gib"] <= (limit or 0)):
        lo = seed["frames"]
    measured = seed.get("fits") and seed.get("peak_gib") is not None and limit
    points = [(seed["frames"], seed["peak_gib"])] if measured else []
    resident = seed.get("resident_gib") or 0.0
    guess = _predict(points, resident, limit) if measured else a.max_frames
    step = min(a.frame_step, max(1, guess // 8))  # short limits get finer steps
    while len(probes) < a.probes + 1 and not runner.out_of_time():
        if hi is None:
            predicted = _predict(points, resident, limit) if points else a.max_frames
            frames = max(min(predicted, a.max_frames) // step * step, lo + step)
        else:
            frames = (lo + hi) // 2 // step * step
            if frames <= lo:
                break
        if frames > a.max_frames:
            break
        row = runner.child("probe", variant, frames)
        probes.append(row)
        if row.get("fits"):
            lo = frames
            if row.get("peak_gib") is not None:
                points.append((frames, row["peak_gib"]))
        else:
            hi = frames
        if hi is not None and hi - lo <= step:
            break
    capped = hi is None and lo >= a.max_frames - step
    tokens_per_frame = 4 if a.tiny else 1560  # (height / 2) x (width / 2) patches
    return {
        "variant": variant,
        "label": VARIANTS[variant].label,
        "longest_frames": lo,
        "longest_tokens": lo * tokens_per_frame,
        "first_failing_frames": hi,
        "capped": capped,
        "probes": probes,
    }


def run_probes(runner: Runner, wanted: list[str]) -> list[dict[str, Any]]:
    """One probe per ``VARIANT@FRAMES``, in the order given; prints whether each fits."""
    rows = []
    for item in wanted:
        variant, _, frames = item.partition("@")
        if runner.out_of_time():
            print("time budget reached; probes left out")
            break
        row = runner.child("probe", variant, int(frames))
        rows.append(row)
        peak = row.get("peak_gib")
        shown = f", peak {peak:.2f} GiB, step {row['step_s']:.1f} s" if peak is not None else ""
        verdict = "fits" if row.get("fits") else f"fails ({row.get('reason', '')[:160]})"
        print(f"probe {variant} @ {frames} frames: {verdict}{shown}")
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| setting | samples/s | step time vs no checkpointing | peak GiB | offloaded GiB/step |"
    )
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = f"{r['time_x']:.2f}" if r.get("time_x") is not None else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        moved = r.get("offloaded_gib_per_step")
        moved = f"{moved:.1f}" if moved is not None else "-"
        print(f"| {r['label']} | {r['samples_per_s']:.3f} | {ratio} | {peak} | {moved} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny Wan config (smoke run)")
    parser.add_argument("--frames", type=int, default=11, help="latent frames of the table")
    parser.add_argument("--variants", nargs="*", default=TABLE, choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--backend", help="torch.compile backend (default: inductor; cpu: aot_eager)"
    )
    parser.add_argument("--auto-budget-gib", type=float, default=40.0)
    parser.add_argument(
        "--offload-blocks-in-flight",
        type=int,
        help="blocks whose offload copies may still run when the next block starts (default: "
        "the offloader's)",
    )
    parser.add_argument("--precision", default="autocast", choices=["autocast", "bf16-mixed"])
    parser.add_argument(
        "--mlp-chunk-tokens",
        type=int,
        help="optimization.memory.mlp_chunk_tokens of every LiteGen variant (default: off)",
    )
    parser.add_argument("--longest", action="store_true", help="search the longest sequences")
    parser.add_argument(
        "--probe", nargs="+", default=[], metavar="VARIANT@FRAMES", help="single probes"
    )
    parser.add_argument(
        "--longest-variants", nargs="+", default=LONGEST, choices=LONGEST, help="in this order"
    )
    parser.add_argument("--memory-limit-gib", type=float, help="cap of every probe (longest)")
    parser.add_argument("--seed-frames", type=int, default=3)
    parser.add_argument(
        "--seed-from", type=Path, help="a table's JSON whose peaks predict the longest search"
    )
    parser.add_argument("--frame-step", type=int, default=4)
    parser.add_argument("--max-frames", type=int, default=400)
    parser.add_argument("--probes", type=int, default=4, help="probes per search after the seed")
    parser.add_argument("--child-timeout-s", type=float, default=300)
    parser.add_argument("--time-budget-s", type=float, default=540)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    for item in args.probe:
        variant, _, frames = item.partition("@")
        if variant not in VARIANTS or not frames.isdigit():
            parser.error(f"--probe {item}: write VARIANT@FRAMES, VARIANT one of {list(VARIANTS)}")
    if args.child:
        opts = json.loads(args.child)
        row = time_variant(opts) if opts["mode"] == "time" else probe(opts)
        print(RESULT + json.dumps(row), flush=True)
        return
    if args.backend is None:
        args.backend = "aot_eager" if args.device == "cpu" else "inductor"
    if args.tiny:
        args.warmup, args.steps = min(args.warmup, 2), min(args.steps, 2)
        args.frames = min(args.frames, 2)
        args.seed_frames, args.frame_step, args.max_frames = 1, 1, min(args.max_frames, 3)
    import diffusers
    import torch

    runner = Runner(args)
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "model": "Wan 2.1 1.3B (tiny)" if args.tiny else "Wan 2.1 1.3B",
        "frames": args.frames,
        "backend": args.backend,
        "offload_blocks_in_flight": args.offload_blocks_in_flight,
        "precision": args.precision,
        "mlp_chunk_tokens": args.mlp_chunk_tokens,
        "memory_limit_gib": args.memory_limit_gib,
    }
    rows = run_table(runner, args.variants, args.frames) if args.variants else []
    if rows:
        result["device_name"] = rows[0].get("device_name")
        result["table"] = rows
        print_table(rows)
    if args.longest:
        seeds = rows
        if args.seed_from is not None:  # a table written before, at its own frame count
            earlier = json.loads(args.seed_from.read_text())
            seeds = [{**r, "frames": earlier["frames"]} for r in earlier.get("table", [])]
        searches = []
        for variant in args.longest_variants:
            seed = next((r for r in seeds if r["variant"] == variant), None)
            if seed is not None:
                seed = {"frames": args.frames, **seed, "fits": True}
            searches.append(longest(runner, variant, seed))
            found = searches[-1]
            note = " (cap)" if found["capped"] else ""
            print(
                f"{found['label']}: {found['longest_frames']} frames, "
                f"{found['longest_tokens']} tokens{note}"
            )
        result["longest"] = searches
    if args.probe:
        result["probes"] = run_probes(runner, args.probe)
    result["wall_s"] = time.perf_counter() - runner.start
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
