"""What the training loop runs for a fine-tuning recipe: ``build``, ``train_step``, the
learning-rate schedule and caption dropout.

Example::

    parts = build(config)     # model, optimizer, data, lr_schedule, family, objective, ...
    loss = train_step(batch, parts["model"], parts["family"], parts["objective"],
                      parts["caption_dropout"])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from litegen.families import Family
from litegen.families.base import empty_caption_key
from litegen.finetune.cache import cached_data
from litegen.finetune.expert_models import ExpertSchedule, expert_schedule, load_experts
from litegen.finetune.pipeline import (
    load_transformer,
    make_objective,
    pipeline_family,
    pipeline_folder,
    read_json,
    settings,
)
from litegen.objectives import FlowMatching


@dataclasses.dataclass(frozen=True)
class CaptionDropout:
    """Each sample's text embeddings swapped for the empty caption's with ``probability``
    (drawn from the training RNG): the unconditional half classifier-free guidance samples
    with. Where the batch holds a sample's own empty caption (:func:`empty_caption_key`: the
    family's text encoder reads a condition too), that one. Not indexable, so ``build``'s dict hands it to ``train_step`` as it is.

    Example:
        >>> batch = {"latents": torch.zeros(4, 2), "prompt_embeds": torch.ones(4, 3, 2)}
        >>> dropout = CaptionDropout(1.0, {"prompt_embeds": torch.zeros(3, 2)})
        >>> dropout(batch)["prompt_embeds"].sum()
        tensor(0.)
    """

    probability: float
    empty: dict[str, torch.Tensor]

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.probability <= 0:
            return batch
        some = next(iter(batch.values()))
        dropped = torch.rand(some.shape[0], device=some.device) < self.probability
        out = dict(batch)
        for name, value in self.empty.items():
            # A family whose text encoder reads a condition brings each sample's own empty caption.
            value = batch.get(empty_caption_key(name), value)
            mask = dropped.view(-1, *([1] * (batch[name].dim() - 1)))
            out[name] = torch.where(mask, value.to(batch[name]), batch[name])
        return out


@dataclasses.dataclass
class LRFactor:
    """The factor of ``lr`` at optimizer step ``s`` (from 0): ``(s + 1) / warmup_steps`` during
    the warmup, then 1 (``constant``) or a ``linear``/``cosine`` decay toward 0 at ``max_steps``.
    A dataclass, so that the scheduler's state in a run checkpoint holds its fields.

    Example:
        >>> [round(LRFactor("linear", 2, 6)(s), 2) for s in range(6)]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """

    name: str
    warmup_steps: int
    max_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.name == "constant":
            return 1.0
        progress = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        if self.name == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def lr_schedule(config: Any, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """``finetune.lr_schedule`` as a ``LambdaLR`` over ``optimizer`` (the loop steps it once
    per optimizer step)."""
    schedule = settings(config).lr_schedule
    factor = LRFactor(schedule.name, schedule.warmup_steps, config.max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build(config: Any) -> dict[str, Any]:
    """The pipeline's transformer, AdamW over what trains and its LR schedule, the cached
    samples, the family and the objective."""
    family = pipeline_family(config)
    if config.trainer.sample_every and not config.trainer.validation.prompts:
        raise ValueError(
            "trainer.sample_every is set but trainer.validation.prompts is empty: give the "
            "prompts to sample, or set trainer.sample_every=0."
        )
    data, empty_prompt = cached_data(config, family)
    experts = expert_schedule(config, read_json(pipeline_folder(config) / "model_index.json"))
    model = load_experts(config, experts) if experts else load_transformer(config)
    # One fused kernel per step on CUDA, as a hand-written loop would use; torch's own
    # choice (foreach) elsewhere. A backend in optimization.optimizer still overrides it.
    on_cuda = config.runtime.device not in ("cpu", "meta") and torch.cuda.is_available()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=on_cuda or None
    )
    dropout = settings(config).data.caption_dropout
    return {
        "model": model,
        "optimizer": optimizer,
        "lr_schedule": lr_schedule(config, optimizer),
        "data": data,
        "family": family,
        "objective": make_objective(config),
        "caption_dropout": CaptionDropout(float(dropout), empty_prompt),
        "experts": experts,  # two-expert pipelines: which expert trains at each step
    }


def train_step(
    batch: dict[str, torch.Tensor],
    model: Any,
    family: Family,
    objective: FlowMatching,
    caption_dropout: CaptionDropout,
    experts: ExpertSchedule | None = None,
    step: int = 1,
) -> torch.Tensor:
    """The flow-matching loss of one micro-batch of cached latents; with two experts, at the
    noise levels of optimizer step ``step``'s expert."""
    if experts is not None:
        objective = experts.objective(step, objective)
    return family.loss(model, caption_dropout(batch), objective)


__all__ = ["CaptionDropout", "LRFactor", "build", "lr_schedule", "train_step"]
