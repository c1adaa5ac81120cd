"""Memory optimisations: activation checkpointing and CPU offload of a model's blocks.

``prepare`` calls :func:`apply_memory_optimizations` once per trainable model, after casting and
kernel replacement and before the strategy wraps the model (torchtitan's order: checkpointing,
then compile, then sharding), so it works the same under every strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from litegen.blocks import repeated_blocks
from litegen.memory.checkpointing import checkpoint_modules, is_checkpointed, select_evenly
from litegen.memory.offload import ActivationOffloader, OffloadStats

__all__ = [
    "ActivationOffloader",
    "MemoryReport",
    "OffloadStats",
    "apply_memory_optimizations",
    "checkpoint_modules",
    "is_checkpointed",
    "select_evenly",
]


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


def apply_memory_optimizations(
    model: nn.Module, memory: Any, *, candidates: list[str] | None = None
) -> MemoryReport:
    """Checkpoint (and offload) the blocks ``optimization.memory`` asks for, in place.

    ``memory`` is an ``optimization.memory`` section (``MemoryConfig``). The blocks chosen from
    are ``activation_checkpoint.target_paths`` when given, else ``candidates`` (``prepare``
    passes the strategy's :meth:`~litegen.parallel.base.Strategy.checkpoint_candidates`), else
    the model's repeated blocks; all in forward (registration) order.

    Example:
        >>> cfg = MemoryConfig(activation_checkpoint={"enabled": True, "selective_ratio": 0.5})
        >>> apply_memory_optimizations(dit, cfg).checkpointed
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
    if ac.target_paths:
        candidates = list(ac.target_paths)
    elif candidates is None:
        candidates = repeated_blocks(model)
    chosen = select_evenly(candidates, ac.selective_ratio)
    offloader = ActivationOffloader() if memory.activation_offload and chosen else None
    checkpoint_modules(model, chosen, policy=ac.policy, offloader=offloader)
    return MemoryReport(candidates, chosen, ac.policy, offloader)
