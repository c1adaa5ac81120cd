"""Peak-memory measurement for the GPU tests: the peak a step adds above where it started."""

from __future__ import annotations

import gc

import torch


def start_peak() -> int:
    """Collect garbage, reset the peak counter, and return the bytes allocated now.

    Modules an earlier test compiled sit in reference cycles once ``torch._dynamo.reset()`` lets
    go of them. Left for the collector to find in the middle of a measured step (compiling
    allocates enough objects to run it), their memory would be freed there and lower that step's
    peak above its start, so results would depend on which tests ran before.
    """
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_since(start: int) -> int:
    """The peak allocated since :func:`start_peak`, above what was allocated then."""
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start
