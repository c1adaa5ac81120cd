"""Two-expert pipelines (Wan 2.2 A14B): the experts' names and what ``finetune.experts`` gets
wrong, without torch (the checks before launch import this).

A pipeline folder with ``transformer``, ``transformer_2`` and ``boundary_ratio`` in its
``model_index.json`` denoises with ``transformer`` (the *high*-noise expert) at timesteps
``t >= boundary_ratio * num_train_timesteps`` and with ``transformer_2`` (the *low*-noise
expert) below. ``finetune.experts`` (default: both) names the experts a run trains; how they
train is :mod:`litegen.finetune.expert_models`.

Example:
    >>> pipeline_boundary({"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875})
    0.875
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# finetune.experts' names -> the pipeline component each one is.
EXPERTS = {"high": "transformer", "low": "transformer_2"}


def pipeline_boundary(model_index: Mapping[str, Any]) -> float | None:
    """``boundary_ratio`` of a two-expert ``model_index.json``; None for one transformer."""
    two = model_index.get("transformer_2") not in (None, [None, None])
    ratio = model_index.get("boundary_ratio")
    return float(ratio) if two and ratio is not None else None


def configured_experts(config: Any) -> tuple[str, ...]:
    """``finetune.experts`` (both when unset), in the pipeline's order."""
    named = config.finetune.experts or list(EXPERTS)
    return tuple(name for name in EXPERTS if name in named)


def expert_label(component: str) -> str:
    """``high_noise`` or ``low_noise``: the file-name part of an expert's export."""
    return {c: f"{e}_noise" for e, c in EXPERTS.items()}[component]


def expert_problems(config: Any, model_index: Mapping[str, Any]) -> list[str]:
    """What ``finetune.experts`` gets wrong for this pipeline (before any rank starts)."""
    if config.finetune.experts and pipeline_boundary(model_index) is None:
        return [
            f"field 'finetune.experts': {list(config.finetune.experts)} names experts, but "
            f"finetune.pipeline {config.finetune.pipeline} has one transformer (no "
            "transformer_2 and boundary_ratio in model_index.json); leave finetune.experts unset."
        ]
    return []


__all__ = ["EXPERTS", "configured_experts", "expert_label", "expert_problems", "pipeline_boundary"]
