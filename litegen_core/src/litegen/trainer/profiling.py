"""``trainer.profile``: a torch profiler trace of a few training steps, and its summary.

Every rank writes ``<results_dir>/profile/rank_<r>.json`` (a Chrome trace: chrome://tracing or
https://ui.perfetto.dev) and, on CUDA, ``memory_rank_<r>.pickle`` (an allocator snapshot:
https://pytorch.org/memory_viz). Rank 0 logs where the time went: by kernel category, and the
communication not hidden behind compute on the device. Each profiled step is a ``step <N>``
range in the trace. When ``trainer.profile`` is unset, nothing here is created.

Example::

    profiler = StepProfiler(config.trainer.profile, Path("results/dit"), device, rank=0)
    profiler.before_step(5); run_step(); profiler.after_step(5)
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from litegen.checkpoint.layout import PROFILE_DIR
from litegen.config.training import ProfileConfig

log = logging.getLogger("litegen")

# First match wins, so collectives named after the op they reduce (an "all_reduce" kernel of
# NCCL's) count as communication and fused attention kernels as attention, not matmul.
CATEGORIES = (
    # c10d:: covers the collectives' host ops (c10d::broadcast_, not aten::broadcast_tensors).
    (
        "communication",
        re.compile(r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all", re.I),
    ),
    ("attention", re.compile(r"attention|attn|flash|fmha|sdpa|softmax", re.I)),
    ("matmul", re.compile(r"gemm|matmul|\bmm\b|aten::[a-z_]*mm\b|linear|cutlass|xmma|nvjet", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy_|aten::to\b|_to_copy|contiguous", re.I)),
)
OTHER = "elementwise/other"
_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def category(name: str) -> str:
    """The summary's category of a kernel or operator name.

    Example:
        >>> category("ncclDevKernel_AllReduce_Sum_bf16_RING_LL")
        'communication'
    """
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), OTHER)


class StepProfiler:
    """Profiles steps ``start .. start + steps - 1`` (steps count from 1); every rank calls it."""

    def __init__(self, cfg: ProfileConfig, results_dir: Path, device: torch.device, rank: int):
        self.first, self.last = cfg.start, cfg.start + cfg.steps - 1
        self.folder = Path(results_dir) / PROFILE_DIR
        self.device, self.rank = device, rank
        self.cuda = device.type == "cuda"
        self._profile: profile | None = None
        self._range: record_function | None = None
        self._memory = False
        self.summary: list[str] = []

    @property
    def trace_path(self) -> Path:
        return self.folder / f"rank_{self.rank}.json"

    def before_step(self, step: int) -> None:
        if step == self.first:
            self._start()
        if self._profile is not None:
            self._range = record_function(f"step {step}")
            self._range.__enter__()

    def after_step(self, step: int) -> None:
        if self._profile is None:
            return
        self._range.__exit__(None, None, None)
        if step == self.last:
            self._stop()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profile = profile(activities=activities)
        if self.cuda:
            self._memory = _record_memory_history(True)
        self._profile.start()

    def _stop(self) -> None:
        self._profile.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.trace_path))
        self._profile = None
        if self._memory:
            with _guarded():
                torch.cuda.memory._dump_snapshot(
                    str(self.folder / f"memory_rank_{self.rank}.pickle")
                )
            _record_memory_history(False)
        if self.rank == 0:
            events = json.loads(self.trace_path.read_text(encoding="utf-8"))["traceEvents"]
            self.summary = summarize(events, steps=self.last - self.first + 1, path=self.trace_path)
            for line in self.summary:
                log.info("%s", line)


def summarize(events: list[dict[str, Any]], *, steps: int, path: Path | str) -> list[str]:
    """One screen on a Chrome trace's events: time per step by category, exposed communication.

    With device kernels in the trace (CUDA), it sums them; exposed communication is the time
    communication kernels run while no other kernel does. Without (CPU), it sums the operators'
    own time (their duration less their children's); their communication runs on the host and
    blocks the thread that calls it, so all of it counts as exposed.
    """
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in spans if e.get("cat") in _DEVICE_CATEGORIES]
    timed = (
        [(e["name"], float(e["ts"]), float(e["dur"])) for e in device]
        if device
        else _self_times([e for e in spans if e.get("cat") == "cpu_op"])
    )
    totals: dict[str, float] = {label: 0.0 for label, _ in CATEGORIES}
    totals[OTHER] = 0.0
    comm, compute = [], []
    for name, start, dur in timed:
        label = category(name)
        totals[label] += dur
        (comm if label == "communication" else compute).append((start, start + dur))
    exposed = _uncovered(comm, compute) if device else totals["communication"]
    total = sum(totals.values()) or 1.0
    where = "device kernels" if device else "CPU operators (self time)"
    lines = [f"profile: {steps} step(s), {where}, trace {path}"]
    for label, micros in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(
            f"  {label:<18} {micros / steps / 1e3:9.2f} ms/step  {100 * micros / total:5.1f}%"
        )
    lines.append(
        f"  {'exposed comm.':<18} {exposed / steps / 1e3:9.2f} ms/step  "
        f"{100 * exposed / total:5.1f}%"
    )
    return lines


def _self_times(ops: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(name, start, own time) of nested host operators, per thread."""
    ops = sorted(ops, key=lambda e: (e.get("pid"), e.get("tid"), e["ts"], -e["dur"]))
    own = [float(e["dur"]) for e in ops]
    stack: list[int] = []
    for i, e in enumerate(ops):
        while stack and not _inside(e, ops[stack[-1]]):
            stack.pop()
        if stack:
            own[stack[-1]] -= float(e["dur"])
        stack.append(i)
    return [(e["name"], float(e["ts"]), max(t, 0.0)) for e, t in zip(ops, own, strict=True)]


def _inside(e: dict[str, Any], parent: dict[str, Any]) -> bool:
    same_thread = (e.get("pid"), e.get("tid")) == (parent.get("pid"), parent.get("tid"))
    return same_thread and e["ts"] + e["dur"] <= parent["ts"] + parent["dur"]


def _uncovered(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of ``spans`` outside the union of ``cover``."""
    merged: list[list[float]] = []
    for start, end in sorted(cover):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [a for a, _ in merged]
    left = 0.0
    for start, end in spans:
        hidden = 0.0
        # The merged intervals are disjoint and sorted: only those from the one before start on.
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(merged) and merged[i][0] < end:
            hidden += max(0.0, min(end, merged[i][1]) - max(start, merged[i][0]))
            i += 1
        left += (end - start) - hidden
    return left


def _record_memory_history(on: bool) -> bool:
    """Start or stop the allocator's history (private torch API: guarded); True when on."""
    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    if record is None:
        return False
    with _guarded():
        record(max_entries=100_000) if on else record(enabled=None)
        return on
    return False


@contextlib.contextmanager
def _guarded() -> Iterator[None]:
    """Logs and swallows a failure of torch's private memory-snapshot API."""
    try:
        yield
    except Exception as exc:
        log.warning("profile: no CUDA memory snapshot (%s)", exc)


__all__ = ["StepProfiler", "category", "summarize"]
