"""Memory optimisations: repeated-block detection, activation checkpointing and CPU offload.

``prepare`` calls :func:`apply_memory_optimizations` once per trainable model, after casting and
kernel replacement and before the strategy wraps the model (torchtitan's order: checkpointing,
then compile, then sharding), so it works the same under every strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from litegen.memory.blocks import repeated_blocks
from litegen.memory.checkpointing import checkpoint_modules, is_checkpointed, select_evenly
from litegen.memory.offload import ActivationOffloader, OffloadStats

__all__ = [
    "ActivationOffloader",
    "MemoryReport",
    "OffloadStats",
    "apply_memory_optimizations",
    "checkpoint_modules",
    "is_checkpointed",
    "repeated_blocks",
    "select_evenly",
]

_SHARDING_STRATEGIES = ("fsdp2", "hsdp")


@dataclass
class MemoryReport:
    """What :func:`apply_memory_optimizations` did to one model."""

    candidates: list[str] = field(default_factory=list)
    checkpointed: list[str] = field(default_factory=list)
    policy: str = "block"
    offloader: ActivationOffloader | None = None
    memory_budget: float | None = None  # policy memory_budget: applied by compile_blocks

    def describe(self) -> str:
        """One log line, e.g. ``checkpointed 2 of 4 blocks (policy block): b.1, b.3; offload on``."""
        if self.memory_budget is not None:
            return (
                "activation checkpointing: compile's partitioner chooses what the compiled "
                f"blocks save (policy memory_budget, {self.memory_budget})"
            )
        if not self.checkpointed:
            return f"activation checkpointing: none of {len(self.candidates)} candidate blocks"
        offload = "on" if self.offloader is not None else "off"
        return (
            f"activation checkpointing: {len(self.checkpointed)} of {len(self.candidates)} "
            f"blocks (policy {self.policy}): {', '.join(self.checkpointed)}; "
            f"activation offload {offload}"
        )


def candidate_blocks(model: nn.Module, checkpoint_cfg: Any, strategy: Any = None) -> list[str]:
    """The modules selective checkpointing chooses from, in forward (registration) order.

    ``target_paths`` wins when given; under fsdp2/hsdp the planned sharding units follow
    (outermost callable ones); otherwise the model's repeated blocks.

    Example:
        >>> candidate_blocks(dit, ActivationCheckpointConfig(enabled=True))
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
    """
    if checkpoint_cfg.target_paths:
        return list(checkpoint_cfg.target_paths)
    name = strategy if isinstance(strategy, str) or strategy is None else strategy.name
    if name not in _SHARDING_STRATEGIES:
        return repeated_blocks(model)
    from litegen.config import FSDP2Config
    from litegen.parallel.wrap import plan_units  # a plan only; no sharding code is loaded

    optimization = getattr(strategy, "optimization", None)
    fsdp2_cfg = optimization.parallel.fsdp2 if optimization is not None else FSDP2Config()
    modules = dict(model.named_modules())
    # Containers (ModuleList/ModuleDict) are never called, so checkpointing them does nothing;
    # of nested units, the outer one saves more and contains the inner one's work.
    units = [
        u
        for u in plan_units(model, fsdp2_cfg)
        if not isinstance(modules[u], nn.ModuleList | nn.ModuleDict)
    ]
    outer = [u for u in units if not any(u.startswith(o + ".") for o in units)]
    order = {n: i for i, n in enumerate(modules)}
    return sorted(outer, key=order.__getitem__)


def apply_memory_optimizations(
    model: nn.Module, memory: Any, *, strategy: Any = None
) -> MemoryReport:
    """Checkpoint (and offload) the blocks ``optimization.memory`` asks for, in place.

    ``memory`` is an ``optimization.memory`` section (``MemoryConfig``); ``strategy`` the
    strategy that will wrap the model (or its name), which decides the candidates.

    Example:
        >>> cfg = MemoryConfig(activation_checkpoint={"enabled": True, "selective_ratio": 0.5})
        >>> apply_memory_optimizations(dit, cfg, strategy="ddp").checkpointed
        ['blocks.1', 'blocks.3']
    """
    ac = memory.activation_checkpoint
    if memory.activation_offload and (not ac.enabled or ac.selective_ratio >= 1.0):
        raise ValueError(
            "optimization.memory.activation_offload moves the inputs of checkpointed blocks, "
            f"but activation_checkpoint has enabled={ac.enabled}, selective_ratio="
            f"{ac.selective_ratio}, so no block is checkpointed; set activation_checkpoint."
            "enabled: true with selective_ratio below 1, or activation_offload: false."
        )
    if not ac.enabled:
        return MemoryReport(policy=ac.policy)
    if ac.policy == "memory_budget":
        # No block is wrapped: compile's partitioner does the recomputation (compile_blocks).
        if memory.activation_offload:
            raise ValueError(
                "optimization.memory.activation_offload moves the inputs of checkpointed "
                "blocks, and activation_checkpoint.policy memory_budget checkpoints none; use "
                "policy block, ops or ops_lean with offload, or set activation_offload: false."
            )
        return MemoryReport(policy=ac.policy, memory_budget=ac.memory_budget)
    candidates = candidate_blocks(model, ac, strategy)
    chosen = select_evenly(candidates, ac.selective_ratio)
    offloader = ActivationOffloader() if memory.activation_offload and chosen else None
    checkpoint_modules(model, chosen, policy=ac.policy, offloader=offloader)
    return MemoryReport(candidates, chosen, ac.policy, offloader)
