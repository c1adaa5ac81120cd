"""The fine-tuning road: train the transformer of a diffusers pipeline folder on a folder of
images and videos with captions, as a recipe's entry (``launch.entry: litegen.finetune``).

    uv run litegen cache build recipes/finetune_video.yaml finetune.pipeline=DIR finetune.data.folder=MEDIA
    uv run litegen launch recipes/finetune_video.yaml finetune.pipeline=DIR finetune.data.folder=MEDIA

The ``finetune`` section of the config (:class:`litegen.config.finetune.FinetuneConfig`) says
what to train on; the pipeline class of ``finetune.pipeline`` picks the family
(:mod:`litegen.families`). The modules, by responsibility:

- :mod:`~litegen.finetune.pipeline`: the folder, its family, transformer and objective;
- :mod:`~litegen.finetune.media`: the media dataset and its checks from a scan;
- :mod:`~litegen.finetune.cache`: the latent cache (keys, encoding, reading);
- :mod:`~litegen.finetune.training`: ``build``, ``train_step``, the LR schedule, caption dropout;
- :mod:`~litegen.finetune.sampling`: validation samples and the export at the end;
- :mod:`~litegen.finetune.checks`: ``check_inputs``, before any rank starts;
- :mod:`~litegen.finetune.experts`, :mod:`~litegen.finetune.expert_models`: two-expert
  pipelines (Wan 2.2 A14B, ``finetune.experts``).

Training reads the cache alone: the VAE and text encoders are loaded again only to sample. The
loss is flow matching with the pipeline scheduler's shift. At the end, ``finish`` writes
``<results_dir>/pipeline`` (full fine-tuning) or ``<results_dir>/lora`` (the LoRA adapters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litegen.finetune.checks import check_inputs

if TYPE_CHECKING:
    import torch

    from litegen.families import Family
    from litegen.finetune.expert_models import ExpertSchedule
    from litegen.finetune.training import CaptionDropout
    from litegen.objectives import FlowMatching

# The hooks below import their module (and torch) when called: the CLI imports this entry to
# run check_inputs before any rank starts, and inspect-config imports no torch.


def build(config: Any) -> dict[str, Any]:
    """:func:`litegen.finetune.training.build`."""
    from litegen.finetune.training import build

    return build(config)


def train_step(
    batch: dict[str, torch.Tensor],
    model: Any,
    family: Family,
    objective: FlowMatching,
    caption_dropout: CaptionDropout,
    experts: ExpertSchedule | None = None,
    step: int = 1,
) -> torch.Tensor:
    """:func:`litegen.finetune.training.train_step`."""
    from litegen.finetune.training import train_step

    return train_step(batch, model, family, objective, caption_dropout, experts, step)


def sample(model: Any, gen: Any, config: Any, family: Family) -> torch.Tensor:
    """:func:`litegen.finetune.sampling.sample`."""
    from litegen.finetune.sampling import sample

    return sample(model, gen, config, family)


def finish(gen: Any, config: Any, model: Any) -> None:
    """:func:`litegen.finetune.sampling.finish`."""
    from litegen.finetune.sampling import finish

    finish(gen, config, model)


def build_cache(config: Any) -> tuple:
    """:func:`litegen.finetune.cache.build_cache`: the hook of ``litegen cache build``."""
    from litegen.finetune.cache import build_cache

    return build_cache(config)


__all__ = ["build", "build_cache", "check_inputs", "finish", "sample", "train_step"]
