"""Where the time of a few training steps went, from a torch.profiler trace of them.

For the question "does the GPU wait for the host?": per step, the wall time, the GPU's busy and
idle time (no kernel running), the host's time blocked in synchronising CUDA calls and the
number of such calls, and the longest GPU gaps with the kernels around them. Used by
``scripts/bench/real_model_entry.py`` (``model.profile_steps``, ``bench_launch.py --profile``)
and ``scripts/lab/profiled_finetune.py``, through :class:`StepProfiler`.

Example:
    >>> prof = torch.profiler.profile(activities=[...]); prof.start(); ...; prof.stop()
    >>> summarize(prof, steps=3, folder=Path("results/run"))["gpu_idle_ms"]
"""

from __future__ import annotations

import gzip
import json
from itertools import pairwise
from pathlib import Path
from typing import Any

from scripts.lab.trace_kernels import union_us

GAP_US = 20.0  # shorter GPU gaps are launch latency between queued kernels
TOP_KERNELS = 8


class StepProfiler:
    """torch.profiler over steps ``[first, last)`` of a training loop, for a recipe's entry.

    Call :meth:`at_step` at the start of each step (the entry's ``train_step``): the trace then
    holds whole steps, backward and optimizer included.

    Example::

        profiler = StepProfiler(30, 33)  # in train_step: profiler.at_step(step)
        profiler.write(Path("results/run"))["gpu_idle_ms"]  # in finish: profile.json
    """

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self._prof: Any = None
        self._stopped = False

    def at_step(self, step: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if step == self.first:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.start()
        elif step == self.last and self._prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._prof.stop()
            self._stopped = True

    def summary(self, folder: Path) -> dict[str, Any] | None:
        """:func:`summarize` of the traced steps; None unless all of them ran."""
        return summarize(self._prof, self.last - self.first, folder) if self._stopped else None

    def write(self, folder: Path) -> dict[str, Any] | None:
        """:meth:`summary`, also written to ``folder/profile.json`` and printed; None (nothing
        written) unless all the traced steps ran."""
        profile = self.summary(folder)
        if profile is not None:
            (folder / "profile.json").write_text(json.dumps(profile, indent=1))
            print(describe(profile), flush=True)
        return profile


def summarize(prof: Any, steps: int, folder: Path) -> dict[str, Any]:
    """Per-step figures of a stopped profiler's trace (also kept as ``profile_trace.json.gz``)."""
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / "profile_trace.json.gz"
    prof.export_chrome_trace(str(trace))  # torch gzips it itself, from the name
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    timed = [e for e in events if "dur" in e and "ts" in e]
    kernels = sorted(
        (e for e in timed if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    host = [e for e in timed if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in host + kernels]
    if not spans:
        return {}
    wall_us = max(stop for _, stop in spans) - min(start for start, _ in spans)
    syncs = [e for e in timed if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]]
    sync_us = sum(e["dur"] for e in syncs)
    busy_us = union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    gaps = []
    for before, after in pairwise(kernels):
        gap = after["ts"] - (before["ts"] + before["dur"])
        if gap > GAP_US:
            gaps.append((gap, before["name"][:60], after["name"][:60]))
    gaps.sort(reverse=True)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e["dur"]
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    per_step = 1e3 * steps
    return {
        "steps": steps,
        "wall_ms": wall_us / per_step,
        "gpu_busy_ms": busy_us / per_step if kernels else None,
        "gpu_idle_ms": (wall_us - busy_us) / per_step if kernels else None,
        "gpu_gaps_over_20us_ms": sum(g for g, _, _ in gaps) / per_step if kernels else None,
        "host_sync_ms": sync_us / per_step,
        "host_busy_ms": (wall_us - sync_us) / per_step,  # queuing work, not waiting on the GPU
        "host_syncs_per_step": len(syncs) / steps,
        "sync_calls": sorted({e["name"] for e in syncs}),
        "longest_gaps": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in gaps[:5]],
        # Which kernels ran (the attention kernel each side picked, say), in ms per step.
        "top_kernels_ms": {name: us / per_step for name, us in top},
    }


def describe(profile: dict[str, Any]) -> str:
    """The figures in ms per step: one line, then the top kernels and the longest gaps."""
    if not profile:
        return "no trace"
    figures = [
        f"{k.removesuffix('_ms')} {v:.2f}"
        for k, v in profile.items()
        if k.endswith("_ms") and isinstance(v, float)
    ]
    lines = [
        f"ms/step: {', '.join(figures)}; host syncs/step {profile['host_syncs_per_step']:.1f} "
        f"{profile['sync_calls']}"
    ]
    lines += [f"  kernel {ms:8.2f} ms  {name}" for name, ms in profile["top_kernels_ms"].items()]
    lines += [
        f"  gap {g['us']:8.1f} us  after {g['after']}  before {g['before']}"
        for g in profile["longest_gaps"]
    ]
    return "\n".join(lines)
