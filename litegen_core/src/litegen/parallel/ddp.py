"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced in buckets."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from litegen.parallel.base import Strategy


class DDPStrategy(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` around the trainable model."""

    name = "ddp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.plan.device)
        device_ids = [self.plan.device] if self.plan.device.type == "cuda" else None
        # Bucket views save one gradient copy; DDP broadcasts rank 0's weights at wrap time.
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return model.no_sync()
