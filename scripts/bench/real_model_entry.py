"""`litegen launch` entry for the diffusers transformers of ``real_models.py``, on synthetic data.

The recipe's ``model:`` section chooses what to train (all fields optional)::

    model:
      name: wan            # a key of real_models.REAL_MODELS
      size: tiny           # tiny | reference (the published config, random weights)
      frames: 21           # latent frames, height, width and text tokens of every sample
      height: 60           #   (default: the size's own latent shape)
      width: 104
      text_tokens: 512
      samples: 16          # synthetic samples in the dataset (made once, held in memory)
      profile_steps: [20, 23]   # trace steps [20, 23) with torch.profiler (step_profile.py)

The model is built on the training device with random weights (nothing is downloaded; on the
meta device, with no memory at all, when ``runtime.device`` is ``meta``), then
AdamW (``fused=True`` on CUDA) over it with the recipe's ``lr`` and ``weight_decay``; the loss is
the zoo's flow-matching MSE. The model reports its tokens per sample, so the logs carry tokens/s.
``finish`` writes ``summary.json`` to the results folder (rank 0): its peak memory, and where
the profiled steps' time went. ``bench_launch.py`` runs it against ``hand_loop.py``, and
``sp_dry_run.yaml`` trains a tiny Wan with sequence parallelism on 2 CPU ranks:

    uv run --locked litegen launch scripts/bench/sp_dry_run.yaml
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from litegen_zoo.real_models import REAL_MODELS, Batch, LatentShape

if TYPE_CHECKING:
    from scripts.lab.step_profile import StepProfiler

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


def settings_of(config: Any) -> dict[str, Any]:
    return dict(config.get("model") or {})


def device_of(config: Any) -> torch.device:
    """Where the model trains; ``meta`` when ``litegen inspect-config --estimate`` asks."""
    if config.runtime.device == "meta":
        return torch.device("meta")
    if config.runtime.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def tokens_per_sample(config: dict, shape: LatentShape) -> int | None:
    """The transformer's sequence length for video models patched in time and space."""
    patch = config.get("patch_size")
    if isinstance(patch, tuple | list) and len(patch) == 3:  # Wan: (t, h, w)
        pt, ph, pw = patch
    elif isinstance(patch, int):
        pt, ph, pw = config.get("patch_size_t") or 1, patch, patch
    else:
        return None
    return -(-shape.frames // pt) * (shape.height // ph) * (shape.width // pw)


def build(config: Any) -> dict:
    settings = settings_of(config)
    spec = REAL_MODELS[settings.get("name", "wan")]
    size = settings.get("size", "tiny")
    default = spec.shape(size)
    shape = LatentShape(
        height=settings.get("height", default.height),
        width=settings.get("width", default.width),
        frames=settings.get("frames", default.frames),
        text_tokens=settings.get("text_tokens", default.text_tokens),
    )
    device = device_of(config)
    with device:  # initialised where it trains: a CPU init of billions of weights takes long
        model = spec.build(size, seed=config.global_seed)
    model.tokens_per_sample = tokens_per_sample(spec.config(size), shape)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        weight_decay=config.weight_decay,
        fused=device.type == "cuda",
    )
    with torch.device("cpu"):  # the samples' generator is a CPU one, whatever the device
        tensors = spec.batch(size, settings.get("samples", 16), config.global_seed, shape)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return {"model": model, "optimizer": optimizer, "dataset": LatentDataset(tensors)}


_profiler: StepProfiler | None = None


def train_step(batch: Batch, model, config, step: int, **_) -> torch.Tensor:
    """The zoo's loss; also starts and stops the profiler at ``model.profile_steps``."""
    global _profiler
    settings = settings_of(config)
    window = settings.get("profile_steps")
    if window is not None:
        from scripts.lab.step_profile import StepProfiler

        _profiler = _profiler or StepProfiler(*window)
        _profiler.at_step(step)
    return REAL_MODELS[settings.get("name", "wan")].loss(model, batch)


def finish(gen: Any, config: Any, **_) -> None:
    # Ranks share the results folder: one writes, as two would corrupt the trace.
    if not gen.is_main_process:
        return
    device = device_of(config)
    summary: dict[str, Any] = {
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
        )
    }
    results = Path(config.get_results_dir())
    profile = _profiler.summary(results) if _profiler is not None else None
    if profile is not None:
        summary["profile"] = profile
    results.mkdir(parents=True, exist_ok=True)
    (results / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
