"""The derived run plan: world size, data-parallel size and per-rank micro batch.

Computed from the recipe alone (no torch, no process group), so a bad batch size is caught
by `inspect-config` and by `launch` before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from litegen_cli.recipe import Recipe, RecipeError

AUTO_DEVICE = "auto (cuda if available, else cpu)"


@dataclass(frozen=True)
class RunPlan:
    """What one launch will do, in numbers."""

    world_size: int
    dp_size: int
    grad_accum_steps: int
    global_batch_size: int
    micro_batch: int
    strategy: str
    device: str
    memory: str = "off"  # activation checkpointing and offload, in words


def _get(section: Any, name: str, default: Any) -> Any:
    """Read an optional field; sections may be missing or hold None."""
    if section is None:
        return default
    try:
        value = getattr(section, name)
    except (AttributeError, KeyError):  # Config raises KeyError for a missing key
        return default
    if isinstance(value, Enum):  # print enums as their value
        value = value.value
    return default if value is None else value


def derive_plan(recipe: Recipe) -> RunPlan:
    """Derive the plan; raise RecipeError when the batch does not split evenly over ranks.

    >>> plan = derive_plan(load_recipe("recipes/digits_dit.yaml"))  # doctest: +SKIP
    >>> plan.world_size, plan.micro_batch  # doctest: +SKIP
    (2, 16)
    """
    cfg = recipe.config
    parallel = _get(_get(cfg, "optimization", None), "parallel", None)
    world = recipe.launch.nproc_per_node * recipe.launch.nnodes
    # sp/cp > 1 divide the world into data-parallel groups.
    model_parallel = 1
    for name in ("sp_size", "cp_size"):
        model_parallel *= int(_get(parallel, name, 1))
    accum = int(_get(_get(cfg, "trainer", None), "grad_accum_steps", 1))
    gbs = int(_get(cfg, "global_batch_size", 1))

    problems = []
    if world % model_parallel:
        problems.append(
            f"field 'optimization.parallel': sp_size*cp_size = {model_parallel} does not divide "
            f"the world size {world} (launch.nproc_per_node * launch.nnodes)"
        )
    dp = max(world // model_parallel, 1)
    if gbs % (dp * accum):
        problems.append(
            f"field 'global_batch_size': {gbs} is not divisible by data-parallel size {dp} "
            f"* trainer.grad_accum_steps {accum} = {dp * accum}"
        )
    if problems:
        raise RecipeError(problems)

    device = _get(_get(cfg, "runtime", None), "device", None)
    return RunPlan(
        memory=_memory(_get(_get(cfg, "optimization", None), "memory", None)),
        world_size=world,
        dp_size=dp,
        grad_accum_steps=accum,
        global_batch_size=gbs,
        micro_batch=gbs // (dp * accum),
        strategy=str(_get(parallel, "strategy", "ddp")),
        device=str(device) if device else AUTO_DEVICE,
    )


def _memory(memory: Any) -> str:
    """Activation checkpointing and offload as the plan table shows them."""
    ac = _get(memory, "activation_checkpoint", None)
    parts = []
    if _get(ac, "enabled", False):
        ratio = _get(ac, "selective_ratio", 1.0)
        if ratio == "auto":
            budget = _get(ac, "memory_budget_gib", None)
            within = (
                f"{budget} GiB"
                if budget is not None
                else f"{_get(ac, 'memory_budget_fraction', 0.9):.0%} of device memory"
            )
            parts.append(f"checkpointing auto within {within}: chosen on the first step")
        else:
            parts.append(
                f"checkpointing selective_ratio {ratio}, policy {_get(ac, 'policy', 'block')}"
            )
    if _get(memory, "activation_offload", False):
        parts.append("activation offload")
    return "; ".join(parts) or "off"
