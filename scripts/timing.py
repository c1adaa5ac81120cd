"""Timers and clean-up shared by the benchmarks (scripts/bench) and the kernel lab (scripts/lab).

Imported, never run:

    from scripts.timing import ms_per_call, sync

Example:
    >>> ms_per_call(lambda: torch.ones(4).sum(), torch.device("cpu"), calls=2) >= 0.0
    True
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch


def release(device: torch.device, reset_compile: bool = True) -> None:
    """Free what a finished benchmark case left behind: compiled graphs, garbage, cached blocks."""
    if reset_compile:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels, so host timers measure them (nothing to wait on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms_per_call(
    fn: Callable[[], object], device: torch.device, calls: int, warmup: int = 3
) -> float:
    """Mean milliseconds of ``fn()`` over ``calls`` calls after ``warmup``, synced around."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls * 1e3


def median_cuda_ms(fn: Callable[[], object], calls: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream, each call between two events.

    For kernel microbenchmarks, where the median of per-call GPU time is steadier than a mean
    over host time (:func:`ms_per_call`).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """GPU kernel time of one ``fn()``, from the CUDA profiler over ``calls`` calls (after one).

    Counts only the kernels' busy time, not gaps or host time (:func:`median_cuda_ms`).
    """
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3
