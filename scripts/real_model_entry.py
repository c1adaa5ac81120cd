"""`litegen launch` entry for the diffusers transformers of ``real_models.py``, on synthetic data.

The recipe's ``model:`` section chooses what to train (all fields optional):

    model:
      name: wan            # a key of real_models.REAL_MODELS
      size: tiny           # tiny | reference (the published config, random weights)
      frames: 21           # latent frames, height, width and text tokens of every sample
      height: 60           #   (default: the size's own latent shape)
      width: 104
      text_tokens: 512
      samples: 16          # synthetic samples in the dataset

The dataset holds ``samples`` synthetic batches (latents, noise, flow time, conditions) and
``train_step`` is the flow-matching loss of ``real_models``; the optimizer is AdamW with the
recipe's ``lr`` and ``weight_decay``. The model reports its tokens per sample (the transformer's
sequence length), so the logs carry tokens/s. ``scripts/sp_dry_run.yaml`` trains a tiny Wan
with sequence parallelism on 2 CPU ranks:

    uv run --locked litegen launch scripts/sp_dry_run.yaml
"""

from __future__ import annotations

import torch
from real_models import REAL_MODELS, LatentShape


class SyntheticSamples(torch.utils.data.Dataset):
    """One sample (a dict of tensors) per index of a synthetic batch."""

    collate_fn = staticmethod(torch.utils.data.default_collate)

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return len(self.batch["latents"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


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


def build(config):
    settings = dict(config.get("model") or {})
    spec = REAL_MODELS[settings.get("name", "wan")]
    size = settings.get("size", "tiny")
    default = spec.shape(size)
    shape = LatentShape(
        height=settings.get("height", default.height),
        width=settings.get("width", default.width),
        frames=settings.get("frames", default.frames),
        text_tokens=settings.get("text_tokens", default.text_tokens),
    )
    model = spec.build(size, seed=config.global_seed)
    model.tokens_per_sample = tokens_per_sample(spec.config(size), shape)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    batch = spec.batch(size, settings.get("samples", 16), config.global_seed, shape)
    return {
        "model": model,
        "optimizer": optimizer,
        "dataset": SyntheticSamples(batch),
        "spec": spec,
    }


def train_step(batch, model, spec):
    return spec.loss(model, batch)
