"""Every parallel strategy through LiteGen and written by hand with plain PyTorch.

One workload (``bench_dit.py``'s, default A) per strategy: LiteGen's ``prepare`` and trainer step
against DistributedDataParallel (ddp), ZeroRedundancyOptimizer over DDP (zero1),
FullyShardedDataParallel with one unit per block (fsdp1) and ``fully_shard`` per block (fsdp2);
same model, precision, fused AdamW and compile setting. ``--ema`` adds an EMA update to every
step on both sides and reports its cost alone. Prints one table, ratios LiteGen / hand-written.

    torchrun --nproc_per_node=2 -m scripts.bench.bench_strategies --workload A --ema --out s.json
    torchrun --nproc_per_node=2 -m scripts.bench.bench_strategies --device cpu --tiny \
        --strategies ddp fsdp1          # CPU smoke run (gloo)
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from scripts.bench.bench_dit import compare, for_each_strategy, parser, print_table, setup
from scripts.bench.bench_profile import print_profiles

HAND_WRITTEN = ("ddp", "zero1", "fsdp1", "fsdp2")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--strategies", nargs="*", default=list(HAND_WRITTEN), choices=HAND_WRITTEN)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device; use --device cpu --tiny for a smoke run")
    cfg, tokens, device = setup(args)
    world = dist.get_world_size()
    pairs, failures = for_each_strategy(
        args, args.strategies, lambda: compare(args, cfg, tokens, device, world)
    )
    rows = [row for pair in pairs for row in pair]
    if dist.get_rank() == 0:
        if args.out:
            result = {
                "workload": args.workload,
                "tokens": tokens,
                "batch_per_gpu": args.batch,
                "world_size": world,
                "compile": args.compile,
                "ema": args.ema,
                "torch": torch.__version__,
                "rows": rows,
                "failures": failures,
            }
            args.out.write_text(json.dumps(result, indent=2))
        print_table(
            rows,
            f"workload {args.workload}, {world} rank(s), compile={args.compile}, "
            f"ema={args.ema}, torch {torch.__version__}",
        )
        print_profiles(rows)
        for strategy, error in failures.items():
            print(f"FAILED {strategy}: {error}")
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
