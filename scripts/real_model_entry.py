"""Entry module that trains a diffusers transformer of ``real_models.py`` on synthetic latents.

``bench_launch.py`` runs it through ``litegen launch`` and through ``hand_loop.py``. The recipe's
``bench`` section says what to build::

    bench:
      model: dit            # a REAL_MODELS name
      size: reference       # or tiny
      frames: 11            # optional: the latent frames (video models), else the model's own
      samples: 256          # dataset size (synthetic samples, made once, held in memory)
      profile_steps: [20, 23]   # optional: trace steps [20, 23) with torch.profiler

The model has random weights (nothing is downloaded), made on the device, before AdamW
(``fused=True`` on CUDA) is built over it. The loss is the zoo's flow-matching MSE. ``finish``
writes ``summary.json`` to the results folder: the peak memory, and where the profiled steps'
time went when ``profile_steps`` is set (``step_profile.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_models import REAL_MODELS, Batch

GIB = 2**30


class LatentDataset(torch.utils.data.Dataset):
    """``samples`` synthetic samples of a model's inputs: dicts of tensors, one sample each."""

    collate_fn = staticmethod(torch.utils.data.default_collate)  # dicts, not (data, caption)

    def __init__(self, tensors: Batch) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i: int) -> Batch:
        return {k: v[i] for k, v in self.tensors.items()}


def device_of(config: Any) -> torch.device:
    if config.runtime.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def build(config: Any) -> dict:
    bench = config.bench
    spec = REAL_MODELS[bench.model]
    shape = spec.shape(bench.size)
    if getattr(bench, "frames", None):
        shape = dataclasses.replace(shape, frames=bench.frames)
    device = device_of(config)
    with device:  # initialised where it trains: a CPU init of billions of weights takes long
        model = spec.build(bench.size, seed=config.global_seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=0.0, fused=device.type == "cuda"
    )
    tensors = spec.batch(bench.size, batch_size=bench.samples, seed=config.global_seed, shape=shape)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return {"model": model, "optimizer": optimizer, "dataset": LatentDataset(tensors)}


_profiler: dict[str, Any] = {}


def train_step(batch: Batch, model, config, step: int, **_) -> torch.Tensor:
    """The zoo's loss; also starts and stops the profiler at ``bench.profile_steps``."""
    window = getattr(config.bench, "profile_steps", None)
    if window is not None and step in window:
        _toggle_profiler(start=step == window[0], steps=window[1] - window[0])
    return REAL_MODELS[config.bench.model].loss(model, batch)


def _toggle_profiler(start: bool, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    if start:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        _profiler["prof"] = profile(activities=activities)
        _profiler["steps"] = steps
        _profiler["prof"].start()
    elif "prof" in _profiler:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _profiler["prof"].stop()


def finish(config: Any, **_) -> None:
    device = device_of(config)
    summary: dict[str, Any] = {
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
        )
    }
    results = Path(config.get_results_dir())
    if "prof" in _profiler:
        from step_profile import summarize

        summary["profile"] = summarize(_profiler["prof"], _profiler["steps"], results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
