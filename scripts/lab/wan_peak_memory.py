"""What is alive at a training step's memory peak: Wan 2.1 1.3B's widths, a few blocks, CUDA.

Builds diffusers' Wan transformer at its published widths with ``--layers`` blocks, prepares it
as ``scripts/bench/bench_memory_real.py`` does (every block checkpointed, optionally offloaded,
MLPs optionally in chunks), trains one warm-up step, then records the allocator's history over one more step and
prints the peak above the resident state and the allocations alive at that peak, grouped by the
line that made them (the inductor kernel call and the model's source line). Sizes are in rows:
one bf16 vector of the model width per token.

    python3 -m scripts.lab.wan_peak_memory --frames 32 --layers 3
    python3 -m scripts.lab.wan_peak_memory --frames 32 --layers 3 --mlp-chunk-tokens 8192
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
from typing import Any

import torch

from litegen_zoo.real_models import REAL_MODELS, LatentShape
from scripts.bench.wan_memory_runs import VARIANTS, _prepare

WIDTH = 1536  # Wan 2.1 1.3B


def _where(event: dict[str, Any], depth: int = 3) -> str:
    """The innermost frames outside torch (generated kernels' calls included), with source."""
    out = []
    for frame in event.get("frames", []):
        name = frame["filename"]
        if name == "??" or ("torch/" in name and "torchinductor" not in name):
            continue
        source = linecache.getline(name, frame["line"]).strip() if os.path.exists(name) else ""
        out.append(f"{os.path.basename(name)}:{frame['line']} {frame['name']} | {source[:100]}")
        if len(out) == depth:
            break
    return " || ".join(out) or "?"


def live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """The traced peak (bytes) and the allocations alive at it, by address."""
    live: dict[int, dict[str, Any]] = {}
    current = best = 0
    best_live: dict[int, dict[str, Any]] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > best:
                best, best_live = current, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    return best, best_live


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=32, help="latent frames (x 1560 tokens)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--mlp-chunk-tokens", type=int)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA: the allocator's history is what it reads")
    from litegen.optim import enable_master_weights

    spec, device = REAL_MODELS["wan"], torch.device("cuda")
    with device:
        model = spec.build("reference", seed=0, num_layers=args.layers)
    model.to(torch.bfloat16)  # the bf16-mixed preset: bf16 parameters, FP32 masters
    opts = {"backend": "inductor", "dynamic": False, "mlp_chunk_tokens": args.mlp_chunk_tokens}
    _prepare(model, VARIANTS["full_offload" if args.offload else "full"], opts, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    enable_master_weights(optimizer)
    shape = LatentShape(60, 104, frames=args.frames, text_tokens=512)
    batch = {k: v.to(device) for k, v in spec.batch("reference", 1, seed=0, shape=shape).items()}

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = spec.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # compiles, and allocates Adam's state
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    row = WIDTH * 2 * args.frames * 1560
    peak = torch.cuda.max_memory_allocated() - resident
    print(f"{args.layers} blocks, {args.frames} frames, chunks {args.mlp_chunk_tokens}: peak above")
    print(
        f"the resident {resident / 2**30:.2f} GiB: {peak / 2**30:.2f} GiB = {peak / row:.1f} rows"
    )
    traced, live = live_at_peak(snapshot["device_traces"][0])
    print(f"traced peak {traced / row:.1f} rows; alive at it, by where they were made:")
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for event in live.values():
        group = groups[_where(event)]
        group[0] += event["size"]
        group[1] += 1
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{size / row:6.2f} rows {count:3d}x  {where}")


if __name__ == "__main__":
    main()
