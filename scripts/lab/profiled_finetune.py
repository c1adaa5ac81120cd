"""The fine-tuning road (``litegen.finetune``) with a few steps traced by torch.profiler.

A recipe's entry: ``launch.entry=scripts.lab.profiled_finetune`` runs ``litegen.finetune``
unchanged and traces steps ``[first, last)`` of ``LITEGEN_PROFILE_STEPS`` (``first,last``,
default ``30,33``). ``finish`` writes ``profile_trace.json.gz`` and ``profile.json`` (GPU busy
and idle time, host syncs, the heaviest kernels and longest gaps: ``step_profile.py``) to the
results folder; ``python -m scripts.lab.trace_kernels DIR/profile_trace.json.gz --steps 3``
names the kernels behind them. With ``scripts/bench/finetune_vs_hand.py``::

    python3 -m scripts.bench.finetune_vs_hand --family wan --sides launch-lab-wan \\
      --launch-override launch.entry=scripts.lab.profiled_finetune max_steps=34
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

import litegen.finetune as road
from litegen.finetune import build, build_cache, check_inputs, sample
from scripts.lab.step_profile import describe, summarize

FIRST, LAST = (int(s) for s in os.environ.get("LITEGEN_PROFILE_STEPS", "30,33").split(","))
_profiler: dict[str, Any] = {}


@functools.wraps(road.train_step)
def train_step(*args: Any, **kwargs: Any) -> torch.Tensor:
    step = kwargs.get("step", 1)
    # A step's train_step runs first in it: starting here and stopping at LAST's traces whole
    # steps, backward and optimizer included.
    if step == FIRST:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        _profiler["prof"] = torch.profiler.profile(activities=activities)
        _profiler["prof"].start()
    elif step == LAST and "prof" in _profiler:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _profiler["prof"].stop()
        _profiler["stopped"] = True
    return road.train_step(*args, **kwargs)


@functools.wraps(road.finish)
def finish(gen: Any, config: Any, model: Any) -> None:
    road.finish(gen, config, model)
    if _profiler.get("stopped") and gen.is_main_process:
        results = Path(config.get_results_dir())
        profile = summarize(_profiler["prof"], LAST - FIRST, results)
        (results / "profile.json").write_text(json.dumps(profile, indent=1))
        print(describe(profile), flush=True)


__all__ = ["build", "build_cache", "check_inputs", "finish", "sample", "train_step"]
