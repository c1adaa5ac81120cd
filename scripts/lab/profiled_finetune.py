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
from scripts.lab.step_profile import StepProfiler, describe

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
        results = Path(config.get_results_dir())
        profile = _profiler.summary(results)
        if profile is not None:
            (results / "profile.json").write_text(json.dumps(profile, indent=1))
            print(describe(profile), flush=True)


__all__ = ["build", "build_cache", "check_inputs", "finish", "sample", "train_step"]
