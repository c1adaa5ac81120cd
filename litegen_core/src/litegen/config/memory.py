"""The ``optimization.memory`` section: activation checkpointing, offload, chunked MLPs and
block swap.

Import the public names from :mod:`litegen.config`. It must never import torch (the CLI
imports it for fast validation).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from litegen.config.base import Section


def blocks_to_checkpoint(selective_ratio: float, candidates: int) -> int:
    """How many of ``candidates`` blocks a numeric ``selective_ratio`` checkpoints: all but
    ``round(selective_ratio * candidates)`` (halves rounded up), so 1.0 checkpoints none.

    >>> blocks_to_checkpoint(0.2, 28), blocks_to_checkpoint(1.0, 28), blocks_to_checkpoint(0, 28)
    (22, 0, 28)
    """
    return candidates - math.floor(selective_ratio * candidates + 0.5)


class ActivationCheckpointConfig(Section):
    """Activation checkpointing (``optimization.memory.activation_checkpoint``)."""

    enabled: bool = False
    selective_ratio: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = Field(
        1.0, description="share left uncheckpointed; auto: the least that fits the budget"
    )
    """``auto`` measures the first training step (every candidate checkpointed) and, from the
    second step, checkpoints the fewest blocks whose estimated peak fits ``memory_budget_gib``
    (or ``memory_budget_fraction`` of the device), offloading only if ``activation_offload``
    allows it and checkpointing alone does not fit."""
    memory_budget_gib: float | None = Field(
        None, gt=0, description="selective_ratio auto: peak device memory to fit, in GiB"
    )
    memory_budget_fraction: float = Field(
        0.9, gt=0.0, le=1.0, description="selective_ratio auto without memory_budget_gib"
    )
    target_paths: list[str] = Field(default_factory=list)
    policy: Literal["block", "ops", "ops_all", "memory_budget"] = "block"
    """``block`` recomputes whole blocks; ``ops`` keeps matmul/attention outputs but those that
    widen their input 4x (MLP up-projections) and recomputes the rest; ``ops_all`` keeps every
    matmul/attention output;
    ``memory_budget`` (needs ``optimization.compile``) lets compile's partitioner choose what
    every compiled block saves, within ``memory_budget``."""
    memory_budget: float = Field(
        0.5, ge=0.0, le=1.0, description="policy memory_budget: 0 saves least, 1 as compile does"
    )
    inside_compile: bool = True
    """With ``optimization.compile``: ``true`` compiles each block with its checkpoint inside
    (compile's partitioner plans the recompute; op-level policies need it), ``false``
    checkpoints the compiled block from outside (as ``checkpoint_wrapper(compiled_block)``)."""

    @model_validator(mode="after")
    def _auto_rules(self) -> ActivationCheckpointConfig:
        fields = type(self).model_fields
        budget_fields = [
            name
            for name in ("memory_budget_fraction", "memory_budget_gib")
            if getattr(self, name) != fields[name].default
        ]
        if self.selective_ratio != "auto" and budget_fields:
            raise ValueError(
                f"{', '.join(budget_fields)} sets the budget of selective_ratio: auto, "
                f"and selective_ratio is {self.selective_ratio}; set selective_ratio: auto, or "
                "remove the budget."
            )
        if self.selective_ratio == "auto" and self.policy != "block":
            raise ValueError(
                "selective_ratio: auto chooses how many blocks to checkpoint whole, and policy is "
                f"{self.policy}; use policy: block with auto, or a number for selective_ratio."
            )
        if not self.inside_compile and self.policy in ("ops", "ops_all"):
            raise ValueError(
                f"policy {self.policy} chooses ops inside the compiled block, which it sees only "
                "with the checkpoint inside compile; set inside_compile: true, or policy: block."
            )
        return self

    def checkpointed_blocks(self, candidates: int) -> int | None:
        """How many of a model's ``candidates`` blocks get checkpointed (``target_paths``, when
        set, are the candidates); None when decided later (``selective_ratio: auto`` on the first
        step, ``policy: memory_budget`` by compile's partitioner).

        >>> ActivationCheckpointConfig(enabled=True).checkpointed_blocks(28)  # ratio 1.0
        0
        """
        if not self.enabled:
            return 0
        if self.selective_ratio == "auto" or self.policy == "memory_budget":
            return None
        n = len(self.target_paths) if self.target_paths else candidates
        return blocks_to_checkpoint(self.selective_ratio, n)

    def checkpoints_nothing(
        self, where: str = "optimization.memory.activation_checkpoint"
    ) -> str | None:
        """The warning for ``enabled: true`` with ``selective_ratio: 1.0`` (the default), which
        checkpoints no block of any model; None otherwise. ``where`` is the section's path.

        >>> ActivationCheckpointConfig(enabled=True).checkpoints_nothing()[:46]
        'optimization.memory.activation_checkpoint.enab'
        """
        if not self.enabled or self.policy == "memory_budget" or self.selective_ratio != 1.0:
            return None
        return (
            f"{where}.enabled is true, but selective_ratio is 1.0 (the default: the share of "
            f"blocks left uncheckpointed), so no block is checkpointed; set {where}."
            "selective_ratio: 0 to checkpoint every block (0.5 for half, auto to fit a memory "
            "budget), or enabled: false."
        )


class BlockSwapConfig(Section):
    """Frozen base weights streamed from host memory (``optimization.memory.block_swap``)."""

    blocks_on_device: int = Field(0, ge=0)
    """Repeated blocks (the first, in forward order) whose frozen weights stay on the device;
    the others' wait in pinned host memory and are copied in ahead of each use."""


class MemoryConfig(Section):
    """Memory savers (``optimization.memory``)."""

    activation_checkpoint: ActivationCheckpointConfig = Field(
        default_factory=ActivationCheckpointConfig
    )
    activation_offload: bool = False
    """Offload the saved activations of the candidate blocks to pinned host memory:
    checkpointed blocks' inputs, everything other blocks save (the last block keeps its own).
    Needs no checkpointing; with ``selective_ratio: auto`` it lets the planner offload when
    checkpointing alone cannot meet the budget."""
    mlp_chunk_tokens: int | None = Field(None, ge=1)
    """Linear-GELU(tanh)-Linear MLPs keep only their input for backward and run this many tokens
    at a time, recomputing their hidden activation in backward (``litegen.memory.mlp_token_chunks``):
    for long sequences, where those wide activations set the peak; one more GEMM per MLP."""
    block_swap: BlockSwapConfig | None = None
    """Under LoRA, keep the frozen base weights of all but ``blocks_on_device`` repeated blocks
    in pinned host memory and stream them in ahead of use (``litegen.memory.block_swap``);
    ``null``: every weight on the device."""
