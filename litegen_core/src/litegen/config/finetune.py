"""The ``finetune`` section of ``MainConfig``: what :mod:`litegen.finetune` trains on and how.

    finetune:
      pipeline: /models/Wan2.1-T2V-1.3B-Diffusers   # a diffusers pipeline folder
      data: {folder: /data/clips, resolution: 480, max_frames: 49}
      objective: {density: logit_normal}
      lr_schedule: {name: cosine, warmup_steps: 100}

Unknown keys are refused with a did-you-mean hint and every range is checked here, without
torch. What needs the pipeline folder or the media (the family's frame rule, which buckets can
fill a global batch) is checked by :func:`litegen.finetune.check_inputs` before the ranks
start. The recipe spellings of earlier versions (``model.pretrained``, ``data.*``,
``objective.*`` at the top level) are read into this section with a
:class:`DeprecatedFieldWarning` (a ``FutureWarning``) naming the new field, when the config has
a ``finetune`` section; the CLI shows them with the recipe's other warnings.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from litegen.config.base import DeprecatedFieldWarning, Section
from litegen.config.checks import near_miss


class FinetuneDataConfig(Section):
    """The media folder and how it is bucketed, encoded and cached (``finetune.data``)."""

    folder: str | None = Field(None, description="images and videos with captions")
    resolution: int = Field(512, ge=1, description="buckets hold about resolution² pixels")
    max_frames: int = Field(
        1, ge=1, description="the longest clip; video families: k * (VAE time compression) + 1"
    )
    frame_stride: int = Field(1, ge=1, description="take every n-th frame of a clip")
    on_bad: Literal["skip", "error"] = Field(
        "skip", description="skip: log bad files and leave them out; error: refuse the folder"
    )
    cache_root: str = Field("cache/finetune", description="latents and text embeddings")
    cache_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    encode_batch_size: int = Field(8, ge=1, description="samples per VAE call when encoding")
    caption_dropout: float = Field(
        0.0, ge=0.0, le=1.0, description="probability of training on the empty caption"
    )
    max_caption_bytes: int = Field(
        1 << 20, ge=1, description="a longer caption (UTF-8) makes its file bad, unread"
    )
    cache_content_digest: bool = Field(
        False,
        description="cache keys from a digest of each file's bytes instead of its size and "
        "modification time (survives copies that reset times; reads every file once)",
    )


class FinetuneObjectiveConfig(Section):
    """The flow-matching objective (``finetune.objective``); the scheduler config of the
    pipeline gives the shift and the number of training timesteps unless set here."""

    density: Literal["uniform", "logit_normal", "mode"] = "logit_normal"
    weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    logit_mean: float | None = None
    logit_std: float | None = Field(None, gt=0.0)
    mode_scale: float | None = None
    shift: float | None = Field(None, gt=0.0, description="None: the scheduler config's")


class LRScheduleConfig(Section):
    """The learning rate over the run (``finetune.lr_schedule``): ``warmup_steps`` rising
    linearly to ``lr``, then ``constant``, or ``linear``/``cosine`` decay to 0 at max_steps."""

    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)


class FinetuneConfig(Section):
    """The fine-tuning road's settings (``finetune``): see docs/finetune.md."""

    pipeline: str | None = Field(None, description="the diffusers pipeline folder to fine-tune")
    data: FinetuneDataConfig = Field(default_factory=FinetuneDataConfig)
    objective: FinetuneObjectiveConfig = Field(default_factory=FinetuneObjectiveConfig)
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    experts: list[Literal["high", "low"]] | None = Field(
        None,
        min_length=1,
        description="two-expert pipelines (Wan 2.2 A14B): the experts to train, high "
        "(transformer) and/or low (transformer_2); None: both",
    )


# Old top-level spelling -> the fields of this section they now are.
RENAMED_SECTIONS = {
    "data": ("data", FinetuneDataConfig),
    "objective": ("objective", FinetuneObjectiveConfig),
}


def _all_fields() -> set[str]:
    return {"pipeline", *FinetuneDataConfig.model_fields, *FinetuneObjectiveConfig.model_fields}


def move_deprecated_fields(data: Any) -> Any:
    """The raw top-level config with the earlier spellings moved into ``finetune`` (a
    ``FutureWarning`` each, and near misses of their names, to be refused with a hint);
    unchanged unless it has a ``finetune`` section. An old spelling
    replaces the section's value: it comes from the user (the recipes ship the new one).

    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     out = move_deprecated_fields({"finetune": {}, "model": {"pretrained": "p"}})
    >>> out, str(caught[0].message)
    ({'finetune': {'pipeline': 'p'}}, 'model.pretrained is deprecated: use finetune.pipeline')
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("finetune"), Mapping):
        return data
    data = dict(data)
    section = dict(data["finetune"])
    moves: list[tuple[str, str, Any]] = []
    model = data.get("model")
    if isinstance(model, Mapping) and "pretrained" in model:
        moves.append(("model.pretrained", "pipeline", model["pretrained"]))
        rest = {k: v for k, v in model.items() if k != "pretrained"}
        data.pop("model") if not rest else data.update(model=rest)
    for old, (new, section_class) in RENAMED_SECTIONS.items():
        values = data.get(old)
        if not isinstance(values, Mapping):
            continue
        # A near miss of a field (data.caption_dropuot) moves too, to be refused by name.
        fields = section_class.model_fields
        known = {k: v for k, v in values.items() if k in fields or near_miss(k, fields)}
        rest = {k: v for k, v in values.items() if k not in known}
        data.pop(old) if not rest else data.update({old: rest})
        moves += [(f"{old}.{key}", f"{new}.{key}", value) for key, value in known.items()]
    for old, new, value in moves:
        if new.rpartition(".")[2] in _all_fields():  # a near miss is refused, not renamed
            message = f"{old} is deprecated: use finetune.{new}"
            warnings.warn(message, DeprecatedFieldWarning, stacklevel=3)
        head, _, field = new.rpartition(".")
        target = section
        if head:
            target = section[head] = dict(section.get(head) or {})
        target[field] = value
    data["finetune"] = section
    return data


__all__ = [
    "DeprecatedFieldWarning",
    "FinetuneConfig",
    "FinetuneDataConfig",
    "FinetuneObjectiveConfig",
    "LRScheduleConfig",
    "move_deprecated_fields",
]
