"""Kernel by kernel: what a kept profiler trace spent its time on.

Traces come from ``scripts/bench/bench_dit.py --profile --trace DIR`` and from
``scripts/bench/bench_launch.py --profile --work DIR``
(``DIR/<model>_<variant>/<side>_<round>/profile_trace.json.gz``).

``bench_dit.py --profile`` sums kernel time by category; this reads one kept trace and names the
kernels behind the sums (the heaviest, in ms per step and calls per step) and the gaps between
them (time with no compute kernel running, by length, and the longest with their neighbours and
the host calls that overlap them):

    torchrun --nproc_per_node=1 -m scripts.bench.bench_dit --workload C --compile --profile --trace traces
    python -m scripts.lab.trace_kernels traces/C_ddp_litegen.json.gz --top 30

Communication kernels (NCCL) run on their own stream, so they are listed but left out of the gaps.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path

GAP_BINS_US = (5, 20, 100, 1000, float("inf"))
# Host-side events of a trace: CUDA runtime calls always, operators and annotations with
# ``scripts/bench/bench_dit.py --trace-host``.
HOST_EVENTS = ("cuda_runtime", "cpu_op", "user_annotation")
# Kernel name fragments per category, checked in this order (attention kernels also use CUTLASS).
# bench_profile.py sums a step's time by these categories. cuDNN's attention backward also runs
# two helper kernels, ``cudnn::fusion::compute_dot_do_o`` (rowsum(dO * O)) and
# ``convert_dq_to_16bits`` (its fp32 dQ to bf16), whose names say neither.
KERNEL_CATEGORIES = (
    ("communication", ("nccl",)),
    (
        "attention",
        ("fmha", "flash", "attention", "sdpa", "cudnn_generated", "dot_do_o", "convert_dq_to"),
    ),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "wgmma", "cublas")),
    ("optimizer", ("multi_tensor", "adam")),
)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, stop) intervals.

    Example:
        >>> union_us([(0, 10), (5, 20), (30, 31)])
        21.0
    """
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def kernel_category(name: str) -> str:
    """The :data:`KERNEL_CATEGORIES` entry a kernel name falls in, or ``elementwise/other``."""
    lowered = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in lowered for f in fragments):
            return category
    return "elementwise/other"


def load_kernels(path: Path, kind: str = "kernel") -> list[dict]:
    """The events of ``kind`` (GPU kernels by default) of a Chrome trace (plain or gzipped
    JSON), in start order."""
    raw = path.read_bytes()
    events = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == kind and "dur" in e]
    return sorted(kernels, key=lambda e: e["ts"])


def heaviest(kernels: list[dict], steps: int, top: int) -> list[tuple[float, int, str]]:
    """(ms per step, calls per step, name) of the ``top`` kernels by total time."""
    busy: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in kernels:
        busy[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    return [(us / steps / 1e3, calls[n] // steps, n) for n, us in busy.most_common(top)]


def gaps(kernels: list[dict]) -> list[tuple[float, str, str, float]]:
    """(µs, kernel before, kernel after, start µs) for every stretch with no compute kernel."""
    compute = [e for e in kernels if kernel_category(e["name"]) != "communication"]
    if not compute:
        return []
    found = []
    last = compute[0]
    end = last["ts"] + last["dur"]
    for e in compute[1:]:
        if e["ts"] > end:
            found.append((e["ts"] - end, last["name"], e["name"], end))
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return found


def host_calls(events: list[dict], start: float, length: float, top: int = 3) -> str:
    """The host events (CUDA runtime calls; operators, with ``--trace-host``) that overlap a
    gap most: what the CPU was doing while the GPU had nothing to run."""
    end = start + length
    overlap: Counter[str] = Counter()
    for e in events:
        if e["ts"] < end and e["ts"] + e["dur"] > start:
            overlap[e["name"]] += min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
    return ", ".join(f"{name[:40]} {us / 1e3:.2f} ms" for name, us in overlap.most_common(top))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--steps", type=int, default=3, help="steps in the trace (--profile: 3)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    kernels = load_kernels(args.trace)
    if not kernels:
        raise SystemExit(f"{args.trace} holds no GPU kernels (a --device cpu run?)")
    busy = sum(e["dur"] for e in kernels) / args.steps / 1e3
    print(f"{len(kernels) // args.steps} kernels, {busy:.1f} ms busy per step")
    by_category: Counter[str] = Counter()
    for e in kernels:
        by_category[kernel_category(e["name"])] += e["dur"]
    print(
        "by category: "
        + ", ".join(f"{c} {us / args.steps / 1e3:.2f} ms" for c, us in by_category.most_common())
    )
    for ms, calls, name in heaviest(kernels, args.steps, args.top):
        print(f"{ms:8.2f} ms {calls:5d}x  {name[:110]}")
    found = gaps(kernels)
    by_bin = Counter(next(b for b in GAP_BINS_US if us < b) for us, *_ in found)
    bins = "  ".join(
        f"<{b:g} us: {by_bin[b] / args.steps:.0f}"
        if b != float("inf")
        else f">=1 ms: {by_bin[b] / args.steps:.0f}"
        for b in GAP_BINS_US
    )
    total = sum(us for us, *_ in found) / args.steps / 1e3
    print(f"\ngaps: {total:.2f} ms per step; count per step by length: {bins}")
    host = [e for kind in HOST_EVENTS for e in load_kernels(args.trace, kind)]
    for us, before, after, start in sorted(found, reverse=True)[:8]:
        print(f"{us / 1e3:6.2f} ms  {before[:55]} -> {after[:55]}")
        if host:
            print(f"           host: {host_calls(host, start, us)}")


if __name__ == "__main__":
    main()
