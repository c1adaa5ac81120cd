"""The fine-tuning road (``litegen.finetune``) with a few steps traced by torch.profiler.

A recipe's entry: ``launch.entry=scripts.lab.profiled_finetune`` runs ``litegen.finetune``
unchanged and traces steps ``[first, last)`` of ``LITEGEN_PROFILE_STEPS`` (``first,last``,
default ``30,33``). ``finish`` writes ``profile_trace.json.gz`` and ``profile.json`` (GPU busy
and idle time, host syncs, the heaviest kernels and longest gaps: ``step_profile.py``) to the
results folder; ``python -m scripts.lab.trace_kernels DIR/profile_trace.json.gz --steps 3``
names the kernels behind them. ``scripts/bench/finetune_vs_hand.py --profile`` runs it (and
sets the steps) beside the hand-written loop's own trace::

    python3 -m scripts.bench.finetune_vs_hand --family wan --windows 2 --profile 21,24 \\
      --sides launch-lab-wan hand-compiled
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

import litegen.finetune as road
from litegen.finetune import build, build_cache, check_inputs, sample
from scripts.lab.step_profile import StepProfiler

FIRST, LAST = (int(s) for s in os.environ.get("LITEGEN_PROFILE_STEPS", "30,33").split(","))
_profiler = StepProfiler(FIRST, LAST)


@functools.wraps(road.train_step)
def train_step(*args: Any, **kwargs: Any) -> torch.Tensor:
    _profiler.at_step(kwargs.get("step", 1))
    return road.train_step(*args, **kwargs)


@functools.wraps(road.finish)
def finish(gen: Any, config: Any, model: Any) -> None:
    road.finish(gen, config, model)
    if gen.is_main_process:
        _profiler.write(Path(config.get_results_dir()))


__all__ = ["build", "build_cache", "check_inputs", "finish", "sample", "train_step"]
