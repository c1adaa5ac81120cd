"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced in buckets.

On a single rank there is nothing to all-reduce, and DDP would only copy every gradient into
its buckets (scaled by 1/world size) each step, so the model is left unwrapped there, as a
single-GPU script would leave it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from litegen.parallel.base import Strategy


class DDPStrategy(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` around the trainable model."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.plan.device)
        if self.plan.world_size == 1:
            return model
        device_ids = [self.plan.device] if self.plan.device.type == "cuda" else None
        # Bucket views save one gradient copy; DDP broadcasts rank 0's weights at wrap time. A
        # model whose steps use a part of it (two experts, one per step) says so.
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            gradient_as_bucket_view=True,
            find_unused_parameters=getattr(model, "uses_part_per_step", False),
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return super().no_sync(model)
