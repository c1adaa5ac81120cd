"""The same DiT trained through LiteGen and through hand-written PyTorch, in one process group.

The microbenchmark of workloads A, B and C (benchmarks/README.md). Both sides use the same model
(``litegen_zoo.dit_model``), precision, fused AdamW, compile setting and attention backend;
LiteGen's side runs the trainer's own step (micro-step, finite check, optimizer step, EMA when
on), the hand-written side the plain loop a user would write. Each side: ``--warmup`` steps, then ``--steps``
steps timed one by one between ``torch.cuda.synchronize()`` calls; the table shows the median.

    torchrun --nproc_per_node=2 -m scripts.bench.bench_dit --workload A --strategy fsdp2 --compile
    torchrun --nproc_per_node=1 -m scripts.bench.bench_dit --workload C --strategy ddp --compile
    torchrun --nproc_per_node=2 -m scripts.bench.bench_dit --workload A --strategy fsdp2 \
        --set optimization.parallel.fsdp2.reshard_after_forward=false   # a LiteGen-only option
    python -m scripts.bench.bench_dit --device cpu --tiny            # CPU smoke run

Workloads (per GPU): A video DiT, hidden 1152, depth 28, 16 heads, 4096 tokens, batch 8;
B hidden 1536, depth 30, 12 heads of 128, 17160 tokens, batch 2; C DiT-XL/2 at 256px,
256 tokens, batch 128. ``--attention-sweep`` also times one attention call (forward and
backward) per SDPA backend at the workload's shape and names the kernel torch picks by default.
``--profile`` traces three more steps per side and splits a step's time by kernel category
(attention, GEMM, elementwise, optimizer, communication, exposed communication, idle); both
live in ``bench_profile.py``, and the two sides in ``dit_runners.py``. On CUDA the table also
gives rank 0's GPU energy per timed step, mean power and SM clock, and the share of the time
the power limit held the clock down (``scripts/lab/gpu_power.py``): at the limit, a step's
time is its energy over the limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import litegen
from litegen.flops.throughput import FlopCounter, peak_flops
from litegen.runtime.distributed import DistEnv
from litegen_zoo.dit_model import DiTConfig
from scripts.bench.bench_profile import attention_sweep, print_profiles, profile_summary
from scripts.bench.dit_runners import HandRunner, LiteGenRunner, litegen_config, make_batch
from scripts.lab.gpu_power import PowerMeter
from scripts.timing import release, sync

GIB = 2**30
WORKLOADS = {  # name -> (model config, tokens per sample, batch per GPU)
    "A": (DiTConfig(hidden=1152, depth=28, heads=16), 4096, 8),
    "B": (DiTConfig(hidden=1536, depth=30, heads=12), 17160, 2),
    "C": (DiTConfig(hidden=1152, depth=28, heads=16), 256, 128),
}


# ------------------------------------------------------------------------------ measurement
def count_flops(runner, batch) -> int:
    """FLOPs of one training step on this rank (eager, counted before timing)."""
    with FlopCounter() as counter:
        runner.step(batch)
    return counter.flops


def measure(name: str, runner, batch, args, device, tokens: int) -> dict:
    flops = count_flops(runner, batch)
    for _ in range(args.warmup):
        runner.step(batch)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    meter = PowerMeter.for_device(device)
    with meter or nullcontext():
        for _ in range(args.steps):
            sync(device)
            start = time.perf_counter()
            runner.step(batch)
            sync(device)
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    power = meter.reading() if meter else {}
    peak = peak_flops(device, args.peak_tflops)
    ema_ms = None
    if args.ema:  # the EMA update alone (it is also inside every timed step)
        ema_times = []
        for _ in range(10):
            sync(device)
            start = time.perf_counter()
            runner.ema_step()
            sync(device)
            ema_times.append(time.perf_counter() - start)
        ema_ms = statistics.median(ema_times) * 1e3
    trace = None
    if args.trace and dist.get_rank() == 0:
        args.trace.mkdir(parents=True, exist_ok=True)
        trace = args.trace / f"{args.workload}_{args.strategy}_{name}.json.gz"
    profile = None
    if args.profile:
        profile = profile_summary(runner, batch, device, keep_trace=trace, host=args.trace_host)
    return {
        "impl": name,
        "step_ms": step_s * 1e3,
        "tokens_per_s_per_gpu": args.batch * tokens / step_s,
        "samples_per_s_per_gpu": args.batch / step_s,
        "tflops_per_gpu": flops / step_s / 1e12,
        "mfu": flops / step_s / peak if peak else None,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB
        if device.type == "cuda"
        else None,
        "ema_ms": ema_ms,
        "profile": profile,
        # This rank's GPU over the timed steps (gpu_power.py): why machine starts differ.
        "joules_per_step": power["joules"] / args.steps if power else None,
        "watts": power.get("watts"),
        "sm_mhz": power.get("sm_mhz"),
        "power_capped": power.get("power_capped"),
    }


def compare(args, cfg: DiTConfig, tokens: int, device: torch.device, world: int) -> list[dict]:
    """LiteGen then hand-written for ``args.strategy``; the LiteGen row carries the ratios."""
    batch = make_batch(cfg, args.batch, tokens, device, seed=dist.get_rank())
    rows = []
    with tempfile.TemporaryDirectory() as results:
        runner = LiteGenRunner(args, cfg, world, results)
        rows.append(measure("litegen", runner, batch, args, device, tokens))
        del runner
        release(device)
    runner = HandRunner(args, cfg, device)
    rows.append(measure("hand", runner, batch, args, device, tokens))
    del runner
    release(device)
    lite, hand = rows
    lite["time_x_hand"] = lite["step_ms"] / hand["step_ms"]
    lite["tokens_x_hand"] = lite["tokens_per_s_per_gpu"] / hand["tokens_per_s_per_gpu"]
    for row in rows:
        row["strategy"] = args.strategy
    return rows


def for_each_strategy(args, strategies: list[str], run: Callable[[], Any]) -> tuple[list, dict]:
    """``run()`` once per strategy (set as ``args.strategy``); returns (results, failures).

    One strategy failing must not hide the others' figures, so its error is recorded (and
    printed on rank 0) in ``failures[strategy]`` and the loop goes on.
    """
    results: list = []
    failures: dict[str, str] = {}
    for strategy in strategies:
        args.strategy = strategy
        try:
            results.append(run())
        except Exception as exc:
            failures[strategy] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            if dist.get_rank() == 0:
                print(f"{strategy} failed: {failures[strategy]}", flush=True)
    return results, failures


def fmt(value, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    head = f"{'strategy':<9}{'impl':<9}{'step ms':>9}{'tok/s/GPU':>11}{'img/s/GPU':>10}"
    head += f"{'MFU':>7}{'peak GiB':>9}{'EMA ms':>8}{'time x':>8}{'tok x':>7}"
    print(head + f"{'J/step':>8}{'W':>6}{'SM MHz':>7}{'capped':>7}")
    for r in rows:
        capped = r.get("power_capped")
        capped_text = "-" if capped is None else f"{100 * capped:.0f}%"
        print(
            f"{r['strategy']:<9}{r['impl']:<9}{r['step_ms']:>9.1f}"
            f"{r['tokens_per_s_per_gpu']:>11.0f}{r['samples_per_s_per_gpu']:>10.1f}"
            f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f'):>7}{fmt(r['peak_gib'], '.1f'):>9}"
            f"{fmt(r.get('ema_ms'), '.2f'):>8}"
            f"{fmt(r.get('time_x_hand'), '.3f'):>8}{fmt(r.get('tokens_x_hand'), '.3f'):>7}"
            f"{fmt(r.get('joules_per_step'), '.1f'):>8}{fmt(r.get('watts'), '.0f'):>6}"
            f"{fmt(r.get('sm_mhz'), '.0f'):>7}{capped_text:>7}"
        )


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--workload", default="A", choices=list(WORKLOADS))
    p.add_argument("--compile", action="store_true", help="regional compile on both sides")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode (both sides)")
    p.add_argument("--attention", default="auto", help="auto, cudnn, flash, efficient, math")
    p.add_argument("--ema", action="store_true", help="update an EMA after every step")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="LiteGen-only config overrides, as on the litegen command line "
        "(optimization.parallel.fsdp2.reshard_after_forward=false)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, help="per GPU (default: the workload's)")
    p.add_argument("--tokens", type=int, help="per sample (default: the workload's)")
    p.add_argument(
        "--peak-tflops", type=float, help="MFU peak (default: litegen.flops.throughput table)"
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke)")
    p.add_argument("--out", type=Path, help="write the results as JSON here (rank 0)")
    p.add_argument("--profile", action="store_true", help="per-step kernel time by category")
    p.add_argument(
        "--trace", type=Path, help="with --profile: keep rank 0's kernel traces in this folder"
    )
    p.add_argument(
        "--trace-host",
        action="store_true",
        help="with --trace: record host operators too (trace_kernels.py names them in gaps)",
    )
    return p


def setup(args) -> tuple[DiTConfig, int, torch.device]:
    """Workload shapes, then a process group via LiteGen's own initialisation; this rank's device."""
    cfg, tokens, batch = WORKLOADS[args.workload]
    if args.tiny:
        cfg, tokens, batch, args.steps, args.warmup = DiTConfig.tiny(), 64, 2, 3, 1
    args.batch = args.batch or batch
    tokens = args.tokens or tokens
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    # Joins torchrun's process group (or makes a one-rank one); each runner initialises LiteGen
    # again with its own config. ddp here: its data-parallel size is the world size, so
    # args.batch per rank is a valid global batch whatever strategy the runners use.
    bootstrap = argparse.Namespace(**{**vars(args), "strategy": "ddp"})
    config = litegen_config(bootstrap, DistEnv.from_environ().world_size, tempfile.gettempdir())
    return cfg, tokens, litegen.initialize(config).device


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--strategy", default="ddp", help="ddp, zero1, fsdp1, fsdp2")
    p.add_argument("--attention-sweep", action="store_true")
    args = p.parse_args()
    if args.trace and not args.profile:
        p.error("--trace keeps the traces --profile takes; add --profile")
    if args.trace_host and not args.trace:
        p.error("--trace-host records host operators in kept traces; add --trace DIR")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device; use --device cpu --tiny for a smoke run")
    cfg, tokens, device = setup(args)
    world = dist.get_world_size()
    runner_rows = compare(args, cfg, tokens, device, world)
    sweep = attention_sweep(cfg, tokens, args.batch, device) if args.attention_sweep else None
    if dist.get_rank() == 0:
        result = {
            "workload": args.workload,
            "model": cfg.__dict__,
            "tokens": tokens,
            "batch_per_gpu": args.batch,
            "world_size": world,
            "compile": args.compile,
            "compile_mode": args.compile_mode,
            "attention": args.attention,
            "litegen_set": args.set,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "rows": runner_rows,
            "attention_sweep": sweep,
        }
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))
        if sweep:
            print("\nattention (fwd+bwd ms):", {r["backend"]: r["ms"] for r in sweep})
            print("default kernels:", sweep[0].get("kernels"))
        title = (
            f"workload {args.workload}, {world} GPU(s), compile={args.compile} "
            f"({args.compile_mode}), "
            f"attention={args.attention}, torch {torch.__version__}"
        )
        if args.set:  # the LiteGen side's own settings (its attention backend, say)
            title += "\nLiteGen only: " + " ".join(args.set)
        print_table(runner_rows, title)
        print_profiles(runner_rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
