"""``to_device``: a batch of nested containers moved to the training device."""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a batch (nested tuples, lists and dicts) to ``device``.

    Example:
        >>> images, captions = to_device((images, captions), torch.device("cuda"))
    """
    if isinstance(batch, torch.Tensor):
        # Pinned host memory (pin_memory: true) copies without blocking the host.
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
