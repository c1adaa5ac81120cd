"""``to_device``: a batch of nested containers moved to the training device."""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a batch (nested tuples, lists and dicts) to ``device``.

    Copies to a GPU never make the host wait: host tensors are pinned first (unless the loader
    pinned them, ``pin_memory: true``), so the copy runs behind the queued kernels while the
    host goes on queuing the step. A copy from pageable memory would wait for the GPU to finish
    all of its queued work.

    Example:
        >>> images, captions = to_device((torch.zeros(2, 3, 8, 8), ["a fox", "a cat"]), torch.device("cpu"))
        >>> images.device, captions
        (device(type='cpu'), ['a fox', 'a cat'])
    """
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        if batch.device.type == "cpu" and device.type == "cuda":
            pinned = batch if batch.is_pinned() else batch.pin_memory()
            return pinned.to(device, non_blocking=True)
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
