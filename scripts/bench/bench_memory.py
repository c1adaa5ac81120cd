"""Step time and peak memory of activation checkpointing and offload on the DiT workload.

For one H200: DiT-XL shapes (hidden 1152, depth 28, 16 heads, MLP 4, adaLN blocks), 4096 tokens per
sample, batch 8, bf16 autocast, AdamW. Every configuration runs twice: through LiteGen
(``apply_memory_optimizations``, the call ``prepare`` makes before the strategy wraps the model) and
as hand-written PyTorch (``torch.utils.checkpoint`` in the model's forward, ``save_on_cpu`` for
offload), with the same blocks checkpointed.

    uv run --no-sync python -m scripts.bench.bench_memory --out bench_memory.json
    uv run --no-sync python -m scripts.bench.bench_memory --max-seq --out max_seq.json
    uv run --no-sync python -m scripts.bench.bench_memory --device cpu --tiny   # smoke check
    python3 -m scripts.bench.bench_memory --compile --cases none ops full --out compiled.json
    python3 -m scripts.bench.bench_memory --compile --cases none ops budget_0.5 budget_0.3

The ``budget_*`` cases (policy ``memory_budget``: compile's partitioner decides what each block
saves) need ``--compile``; by hand they are the same budget set in ``torch._functorch.config``.

``--max-seq`` finds the longest sequence (batch 1) that trains without checkpointing, with
full checkpointing, and with checkpointing plus offload: doubling until out of memory, then
bisecting to ``--seq-step`` tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch

from litegen.compile import compile_blocks
from litegen.config import CompileConfig, MemoryConfig
from litegen.memory import apply_memory_optimizations, select_evenly
from litegen.memory.checkpointing import POLICY_CONTEXTS
from litegen_zoo.dit_model import DiT, DiTConfig, compile_blocks_by_hand, sample_batch
from scripts.bench.length_search import longest
from scripts.timing import release, sync

GIB = 2**30


class Case(NamedTuple):
    """One memory setting: checkpointing on or off, its ratio and policy, offload, budget."""

    checkpoint: bool
    ratio: float
    policy: str
    offload: bool = False
    budget: float | None = None  # policy memory_budget: compile's partitioner decides


CASES: dict[str, Case] = {
    "none": Case(False, 1.0, "block"),
    "full": Case(True, 0.0, "block"),
    "selective_0.25": Case(True, 0.25, "block"),
    "selective_0.5": Case(True, 0.5, "block"),
    "selective_0.75": Case(True, 0.75, "block"),
    "ops": Case(True, 0.0, "ops"),
    "ops_all": Case(True, 0.0, "ops_all"),
    "full_offload": Case(True, 0.0, "block", offload=True),
    **{f"budget_{b}": Case(True, 0.0, "memory_budget", budget=b) for b in (0.5, 0.3, 0.1)},
}


def build(cfg: DiTConfig, case: str, impl: str, device: torch.device, compile_: bool = False):
    """A fresh model and optimizer with ``case``'s checkpointing, by LiteGen or by hand.

    ``compile_``: regional compile of every block, after checkpointing (LiteGen's
    ``compile_blocks``; by hand, ``torch.compile`` per block inside the model's checkpoint call).
    """
    torch.manual_seed(0)
    model = DiT(cfg).to(device)
    enabled, ratio, policy, offload, budget = CASES[case]
    offloader = None
    if impl == "litegen":
        memory = MemoryConfig.model_validate(
            {
                "activation_checkpoint": {
                    "enabled": enabled,
                    "selective_ratio": ratio,
                    "policy": policy,
                    **({"memory_budget": budget} if budget is not None else {}),
                },
                "activation_offload": offload,
            }
        )
        report = apply_memory_optimizations(model, memory)
        offloader = report.offloader
        if compile_:
            compile_blocks(
                model,
                CompileConfig(enabled=True, dynamic=False),
                memory_budget=report.memory_budget,
            )
    elif enabled and budget is None:  # a budget case by hand is only the global config
        names = [f"blocks.{i}" for i in range(cfg.depth)]
        model.hand_checkpoint = {int(n.split(".")[1]) for n in select_evenly(names, ratio)}
        model.hand_context_fn = POLICY_CONTEXTS[policy]
        model.hand_offload = offload
    if compile_ and impl == "hand":
        compile_blocks_by_hand(model)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    return model, optimizer, offloader


def train_step(model, optimizer, batch, device: torch.device) -> None:
    x, t = batch
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    )
    with autocast:
        loss = (model(x, t).float() - x).square().mean()
    loss.backward()
    optimizer.step()
    # Gradients stay allocated between steps, as under DDP's gradient bucket views; the peak
    # then is weights + grads + Adam state + the activation peak checkpointing acts on.
    optimizer.zero_grad(set_to_none=False)


def measure(args, cfg: DiTConfig, case: str, impl: str, device: torch.device) -> dict:
    budget = CASES[case].budget
    if impl == "hand" and budget is not None:  # what a user sets by hand: the global config
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return _measure(args, cfg, case, impl, device)
    return _measure(args, cfg, case, impl, device)


def _measure(args, cfg: DiTConfig, case: str, impl: str, device: torch.device) -> dict:
    model, optimizer, offloader = build(cfg, case, impl, device, args.compile)
    batch = sample_batch(cfg, args.batch, args.tokens, device)
    for _ in range(args.warmup):  # also allocates the optimizer state and pinned buffers
        train_step(model, optimizer, batch, device)
    sync(device)
    before = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    if offloader is not None:
        offloader.stats.reset()
    times = []
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        train_step(model, optimizer, batch, device)
        sync(device)
        times.append(time.perf_counter() - start)
    row = {
        "case": case,
        "impl": impl,
        "step_s": statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB
        if device.type == "cuda"
        else None,
        "activation_peak_gib": (
            (torch.cuda.max_memory_allocated(device) - before) / GIB
            if device.type == "cuda"
            else None
        ),
        "offloaded_gib_per_step": (
            offloader.stats.bytes_offloaded / args.repeats / GIB if offloader else None
        ),
    }
    del model, optimizer, offloader
    release(device)
    return row


def add_ratios(rows: list[dict]) -> None:
    """Step time and peak relative to the same implementation without checkpointing."""
    base = {r["impl"]: r for r in rows if r["case"] == "none"}
    for row in rows:
        ref = base.get(row["impl"])
        row["time_x"] = row["step_s"] / ref["step_s"] if ref else None
        row["peak_x"] = row["peak_gib"] / ref["peak_gib"] if ref and row["peak_gib"] else None


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def print_table(rows: list[dict]) -> None:
    head = ("step s", "x none", "peak GiB", "x none", "act GiB", "offl GiB")
    print(f"{'case':<16}{'impl':<9}" + "".join(f"{h:>10}" for h in head))
    for r in rows:
        values = (
            r["step_s"],
            r["time_x"],
            r["peak_gib"],
            r["peak_x"],
            r["activation_peak_gib"],
            r["offloaded_gib_per_step"],
        )
        digits = (3, 2, 2, 2, 2, 2)
        cells = "".join(_fmt(v, 10, d) for v, d in zip(values, digits, strict=True))
        print(f"{r['case']:<16}{r['impl']:<9}{cells}")


def fits(cfg: DiTConfig, case: str, tokens: int, device: torch.device, model, optimizer) -> bool:
    """One training step at batch 1 and ``tokens`` tokens; False when it runs out of memory."""
    try:
        train_step(model, optimizer, sample_batch(cfg, 1, tokens, device), device)
        sync(device)
        return True
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        return False
    finally:
        release(device, reset_compile=False)


def longest_sequence(args, cfg: DiTConfig, case: str, device: torch.device) -> dict:
    """The most tokens a step fits, to ``--seq-step`` (:func:`length_search.longest`)."""
    model, optimizer, _ = build(cfg, case, "litegen", device, args.compile)
    train_step(model, optimizer, sample_batch(cfg, 1, args.seq_step, device), device)  # Adam state

    def probe(tokens: int) -> bool:
        print(f"  {case}: {tokens} tokens ...", flush=True)
        return fits(cfg, case, tokens, device, model, optimizer)

    good = longest(probe, args.seq_start, args.seq_step, args.seq_cap)
    model = optimizer = None  # frees them before release (probe's cells point here too)
    release(device, reset_compile=False)
    return {"case": case, "max_tokens": good, "capped": good >= args.seq_cap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="small model and batch (smoke)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--cases", nargs="*", choices=list(CASES), help="default: all (budget_* with --compile)"
    )
    parser.add_argument(
        "--impls", nargs="*", default=["litegen", "hand"], choices=["litegen", "hand"]
    )
    parser.add_argument("--compile", action="store_true", help="regional compile of the blocks")
    parser.add_argument("--max-seq", action="store_true", help="find the longest sequence")
    parser.add_argument("--seq-start", type=int, default=8192)
    parser.add_argument("--seq-cap", type=int, default=262144)
    parser.add_argument("--seq-step", type=int, default=2048)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu --tiny for a smoke check")
    if args.tiny:
        args.tokens, args.batch, args.warmup, args.repeats = 64, 2, 1, 2
        args.seq_start, args.seq_cap, args.seq_step = 64, 256, 32
    if args.cases is None:
        args.cases = [c for c in CASES if args.compile or CASES[c].budget is None]
    if not args.compile and any(CASES[c].budget is not None for c in args.cases):
        parser.error("the budget_* cases are carried out by torch.compile; add --compile")
    cfg = DiTConfig.tiny() if args.tiny else DiTConfig()
    device = torch.device(args.device)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    result["workload"] = {**cfg.__dict__, "tokens": args.tokens, "batch": args.batch}
    result["compile"] = args.compile
    result["torch"] = torch.__version__
    if args.max_seq:
        cases = [c for c in ("none", "full", "full_offload") if c in args.cases]
        rows = [longest_sequence(args, cfg, c, device) for c in cases]
        for r in rows:
            print(f"{r['case']:<16}{r['max_tokens']:>9} tokens{' (cap)' if r['capped'] else ''}")
        result["max_seq"] = rows
    else:
        rows = []
        for case in args.cases:
            for impl in args.impls:
                print(f"running {case} / {impl} ...", flush=True)
                rows.append(measure(args, cfg, case, impl, device))
        add_ratios(rows)
        print_table(rows)
        result["rows"] = rows
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
