"""The two sides that ``bench_dit.py`` times: the same DiT step through LiteGen and by hand.

LiteGen's side is ``prepare`` and the trainer's own step (micro-step, finite check, optimizer
step, EMA when on) without data loading and logging; the hand-written side is the plain loop a
user would write with the strategy's PyTorch wrapper. Both use the same model
(``litegen_zoo.dit_model``), loss, precision, fused AdamW, compile setting and attention
backend. Used through ``bench_dit.py``, ``bench_strategies.py`` and ``bench_scaling.py``; it
runs nothing on its own:

    torchrun --nproc_per_node=2 -m scripts.bench.bench_dit --workload A --strategy fsdp2 --compile
    python -m scripts.bench.bench_dit --device cpu --tiny            # CPU smoke run
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

import litegen
from litegen.config import MainConfig
from litegen.kernels.attention import attention_context
from litegen.trainer import Trainer
from litegen_cli.recipe import apply_overrides
from litegen_zoo.dit_model import DiT, DiTConfig, compile_blocks_by_hand, sample_batch

SHARDED = ("fsdp2", "hsdp")  # bf16 through FSDP2's MixedPrecisionPolicy; others autocast


def loss_fn(model, batch) -> torch.Tensor:
    x, t, y = batch
    return (model(x, t, y).float() - x.float()).square().mean()


def make_batch(cfg: DiTConfig, batch: int, tokens: int, device, seed: int = 0) -> tuple:
    """Latent tokens, timesteps and class labels (every parameter gets a gradient)."""
    x, t = sample_batch(cfg, batch, tokens, device, seed)
    return x, t, t % cfg.num_classes


# ------------------------------------------------------------------------------ LiteGen side
def litegen_config(args, world: int, results: str) -> MainConfig:
    bf16 = args.device == "cuda"
    optimization = {
        "parallel": {"strategy": args.strategy},
        "compile": {"enabled": args.compile, "mode": args.compile_mode, "dynamic": False},
        "kernels": {"attention_backend": args.attention},
    }
    if bf16 and args.strategy in SHARDED:
        optimization["precision"] = {"fsdp_mixed": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
    fields = {
        "exp_name": "bench",
        "results_dir": results,
        "runtime": {"device": args.device},
        "global_batch_size": args.batch * world,
        "max_steps": 10**9,
        "optimization": optimization,
        "ema": {"enable": args.ema, "decay": 0.9999},
        "trainer": {
            "autocast": "bf16" if bf16 and args.strategy not in SHARDED else None,
            "save_final": False,
        },
    }
    problems = apply_overrides(fields, args.set)
    if problems:
        raise ValueError("; ".join(problems))
    return MainConfig.from_dict(fields)


class LiteGenRunner:
    """LiteGen's prepare and the trainer's per-step work, without data loading and logging."""

    def __init__(self, args, cfg: DiTConfig, world: int, results: str) -> None:
        self.gen = litegen.initialize(litegen_config(args, world, results))
        torch.manual_seed(0)
        model = DiT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
        dataset = [make_batch(cfg, 1, 8, "cpu")] * world  # only to satisfy the trainer
        model, optimizer, loader = self.gen.prepare(model, optimizer, dataset)
        self.model = model
        self.trainer = Trainer(
            self.gen,
            lambda batch, model: loss_fn(model, batch),
            {"model": model, "optimizer": optimizer, "loader": loader},
        )

    def ema_step(self) -> None:
        self.gen.update_ema()

    def step(self, batch) -> None:
        self.trainer.run_step(iter([batch]))


# -------------------------------------------------------------------------- hand-written side
def wrap_by_hand(model: DiT, strategy: str, device: torch.device, compile_mode: str | None):
    """The strategy as a user would write it with plain PyTorch; returns (model, optimizer)."""
    if compile_mode:  # torchtitan's regional compile: each block, before sharding
        compile_blocks_by_hand(model, compile_mode)
    fused = device.type == "cuda"
    if strategy == "ddp" and dist.get_world_size() == 1:
        model.to(device)  # one GPU: a user writes no wrapper (DDP would only copy gradients)
    elif strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(
            model.to(device),
            device_ids=[device] if fused else None,
            gradient_as_bucket_view=True,
        )
        if strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, fused=fused
            )
            return model, opt
    elif strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        blocks = {type(b) for b in model.blocks}  # DiTBlock, or the compiled wrapper
        model = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy(blocks), use_orig_params=True, device_id=device
        )
    elif strategy in SHARDED:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model.to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mp = mp if fused else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    else:
        raise ValueError(f"no hand-written baseline for strategy {strategy!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)


class HandRunner:
    def __init__(self, args, cfg: DiTConfig, device: torch.device) -> None:
        torch.manual_seed(0)
        self.model, self.optimizer = wrap_by_hand(
            DiT(cfg), args.strategy, device, args.compile and args.compile_mode
        )
        bf16 = device.type == "cuda" and args.strategy not in SHARDED
        self.autocast = torch.autocast("cuda", torch.bfloat16) if bf16 else nullcontext()
        self.attention = lambda: attention_context(args.attention, device)
        self.ema = None
        if args.ema:  # fp32 copy of this rank's (local) parameters, lerped after each step
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.ema = [_local(p).detach().float().clone() for p in self.params]

    def step(self, batch) -> None:
        with self.attention():
            with self.autocast:
                loss = loss_fn(self.model, batch)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema_step()

    @torch.no_grad()
    def ema_step(self) -> None:
        torch._foreach_lerp_(self.ema, [_local(p).float() for p in self.params], 1e-4)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p
