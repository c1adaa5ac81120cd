"""Peak device memory for the training log: allocated and reserved, since the last call.

The trainer calls :func:`peak_memory_since_last_call` at every logged step, so each log line
reports the highest memory of the steps since the previous one (the call resets the peaks).
"""

from __future__ import annotations

import torch

GIB = 2**30


def peak_memory_since_last_call(device: torch.device | str) -> dict[str, float]:
    """Peak allocated and reserved memory in GiB and in % of the device; resets the peaks.

    ``{}`` on a device without allocator statistics (cpu).

    Example::

        peak_memory_since_last_call("cuda:0")
    """
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    total = torch.cuda.get_device_properties(device).total_memory
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    return {
        "peak_allocated_gib": allocated / GIB,
        "peak_reserved_gib": reserved / GIB,
        "peak_allocated_pct": 100.0 * allocated / total,
        "peak_reserved_pct": 100.0 * reserved / total,
    }


def format_peak_memory(peaks: dict[str, float]) -> str:
    """The progress line's memory field, e.g. ``mem 40.2/42.0 GiB (29%)``; ``""`` without peaks.

    Example:
        >>> format_peak_memory({"peak_allocated_gib": 40.2, "peak_reserved_gib": 42.0,
        ...                     "peak_allocated_pct": 28.7, "peak_reserved_pct": 30.0})
        'mem 40.2/42.0 GiB (29%)'
    """
    if not peaks:
        return ""
    return (
        f"mem {peaks['peak_allocated_gib']:.1f}/{peaks['peak_reserved_gib']:.1f} GiB "
        f"({peaks['peak_allocated_pct']:.0f}%)"
    )
