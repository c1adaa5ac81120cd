"""EMA for the bucketed ZeRO strategies: each rank averages exactly the partition it steps.

The partition is the optimizer's own (``buckets.py``), so when master weights are on, every
rank holds the FP32 master of what it averages and the EMA follows it without communication.
Gathering reuses the bucket layout: one all-gather per bucket, then the parameters' ranges.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from litegen.ema import BufferMirror
from litegen.parallel.grad_buckets import Bucket

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class BucketEMA:
    """FP32 EMA of the bucket partitions a ZeRO optimizer steps (the ``litegen.ema.EMA`` API).

    Example::

        ema = BucketEMA(model, buckets, optimizer)
        ema.update(0.999)
        full = ema.state_dict()  # collective
    """

    def __init__(self, model: nn.Module, buckets: list[Bucket], optimizer) -> None:
        self.buckets = buckets
        self.optimizer = optimizer
        self.name_of = {id(p): name for name, p in model.named_parameters()}
        # Parameters no optimizer steps (frozen parts of the model) never change, so they are
        # not averaged; LiteGen.full_ema_state takes them from the model.
        self.shards = [self._source(b).float().clone() for b in buckets]
        self.mirror = BufferMirror(model)

    def _source(self, bucket: Bucket) -> torch.Tensor:
        state = self.optimizer.state.get(bucket.shard)
        master = state.get("master") if state else None
        return (master if master is not None else bucket.shard).detach()

    @torch.no_grad()
    def update(self, decay: float) -> None:
        sources = [self._source(b).float() for b in self.buckets]
        torch._foreach_lerp_(self.shards, sources, 1.0 - decay)
        self.mirror.refresh()

    def state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for bucket, shard in zip(self.buckets, self.shards, strict=True):
            flat = torch.empty(bucket.numel, dtype=torch.float32, device=shard.device)
            _all_gather(flat, shard)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                state[self.name_of[id(p)]] = flat[offset : offset + p.numel()].view(p.shape).cpu()
        state.update(self.mirror.cpu_state())
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for bucket, shard in zip(self.buckets, self.shards, strict=True):
            bucket.read_params(
                shard, bucket.shard_start, bucket.shard_numel, lambda p: state[self.name_of[id(p)]]
            )
        self.mirror.load(state)

    def dcp_state(self) -> dict[str, torch.Tensor]:
        """The gathered average (identical on every rank, so DCP stores it once)."""
        return self.state_dict()

    def load_dcp_state(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state)

    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shards)
