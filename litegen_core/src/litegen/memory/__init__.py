"""Memory savers: activation checkpointing and offload of a model's blocks, budgets, stats.

``prepare`` calls :func:`apply_memory_optimizations` once per trainable model, after casting and
kernel replacement and before compile and the strategy's wrap (torchtitan's order: checkpointing,
then compile, then sharding), so it works the same under every strategy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from litegen.memory.block_forward import BlockForward, block_forward
from litegen.memory.block_swap import BlockSwap, SwapStats
from litegen.memory.budget import BudgetChoice, BudgetChooser
from litegen.memory.checkpointing import (
    checkpoint_modules,
    is_checkpointed,
    select_evenly,
    wrap_blocks,
)
from litegen.memory.mlp_token_chunks import apply_chunked_mlp
from litegen.memory.offload import BLOCKS_IN_FLIGHT, ActivationOffloader, OffloadStats
from litegen.memory.stats import format_peak_memory, peak_memory_since_last_call
from litegen.model_parts.blocks import repeated_blocks

log = logging.getLogger(__name__)

__all__ = [
    "ActivationOffloader",
    "BlockForward",
    "BlockSwap",
    "BudgetChooser",
    "MemoryReport",
    "OffloadStats",
    "SwapStats",
    "apply_chunked_mlp",
    "apply_memory_optimizations",
    "block_forward",
    "checkpoint_modules",
    "format_peak_memory",
    "is_checkpointed",
    "peak_memory_since_last_call",
    "select_evenly",
    "wrap_blocks",
]


@dataclass
class MemoryReport:
    """What :func:`apply_memory_optimizations` did to one model (``planner`` updates it)."""

    candidates: list[str] = field(default_factory=list)
    checkpointed: list[str] = field(default_factory=list)
    policy: str = "block"
    offloader: ActivationOffloader | None = None
    memory_budget: float | None = None  # policy memory_budget: applied by compile_blocks
    offloaded: list[str] = field(default_factory=list)
    planner: BudgetChooser | None = None  # selective_ratio auto
    chunked_mlps: int = 0  # mlp_chunk_tokens
    block_swap: BlockSwap | None = None  # block_swap: set by prepare once the model is wrapped

    @property
    def measuring(self) -> bool:
        """Whether ``selective_ratio: auto`` is still measuring its first step."""
        return self.planner is not None and self.planner.measuring

    def describe(self) -> str:
        """One log line, e.g. ``checkpointed 2 of 4 blocks (policy block): b.1, b.3; offload on``."""
        chunks = f"{self.chunked_mlps} GELU MLPs run in chunks of tokens"
        if self.chunked_mlps and not self.candidates and self.memory_budget is None:
            return chunks  # mlp_chunk_tokens alone: no blocks to speak of
        blocks = self._describe_blocks()
        return f"{blocks}; {chunks}" if self.chunked_mlps else blocks

    def _describe_blocks(self) -> str:
        offload = (
            f"activation offload: {len(self.offloaded)} of {len(self.candidates)} blocks"
            if self.offloader is not None
            else "activation offload off"
        )
        if self.memory_budget is not None:
            return (
                "activation checkpointing: compile's partitioner chooses what the compiled "
                f"blocks save (policy memory_budget, {self.memory_budget}); {offload}"
            )
        if self.planner is not None and self.planner.plan is None:
            budget = self.planner.budget_bytes
            within = (
                f"{budget / 2**30:.2f} GiB"
                if budget is not None
                else f"{self.planner.budget_fraction:.0%} of device memory"
            )
            return (
                f"activation checkpointing: auto within {within}, chosen on the first step "
                f"(all {len(self.candidates)} candidate blocks checkpointed until then); "
                f"offload {'allowed' if self.planner.may_offload else 'off'}"
            )
        if not self.checkpointed:
            return (
                f"activation checkpointing: none of {len(self.candidates)} candidate blocks; "
                f"{offload}"
            )
        return (
            f"activation checkpointing: {len(self.checkpointed)} of {len(self.candidates)} "
            f"blocks (policy {self.policy}): {', '.join(self.checkpointed)}; {offload}"
        )

    def _planned(self, plan: BudgetChoice) -> None:
        self.checkpointed, self.offloaded = list(plan.checkpointed), list(plan.offloaded)


def apply_memory_optimizations(
    model: nn.Module,
    memory: Any,
    *,
    candidates: list[str] | None = None,
    device: torch.device | str | None = None,
) -> MemoryReport:
    """Checkpoint and offload the blocks ``optimization.memory`` asks for, in place.

    ``memory`` is an ``optimization.memory`` section (``MemoryConfig``). The blocks chosen from
    are ``activation_checkpoint.target_paths`` when given, else ``candidates`` (``prepare``
    passes the strategy's :meth:`~litegen.parallel.base.Strategy.checkpoint_candidates`), else
    the model's repeated blocks; all in forward (registration) order. ``device`` is the
    training device (``selective_ratio: auto`` on a CPU needs ``memory_budget_gib``).

    Offload (``activation_offload``) covers every candidate block but the last, whose saved
    tensors the backward needs first: checkpointed blocks' inputs, everything the other blocks
    save. With ``selective_ratio: auto`` every candidate is checkpointed for the first step and
    a :class:`BudgetChooser` sets the blocks from the second (``report.planner``).
    ``mlp_chunk_tokens`` routes the model's GELU MLPs through :mod:`.chunked_mlp` first.

    Example:
        >>> from litegen.config import MemoryConfig
        >>> dit = nn.Module()
        >>> dit.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(4))
        >>> cfg = MemoryConfig(activation_checkpoint={"enabled": True, "selective_ratio": 0.5})
        >>> apply_memory_optimizations(dit, cfg).checkpointed
        ['blocks.1', 'blocks.3']
    """
    ac = memory.activation_checkpoint
    chunked = 0
    if memory.mlp_chunk_tokens is not None:
        chunked = apply_chunked_mlp(model, memory.mlp_chunk_tokens)
        if not chunked:
            log.warning(
                "optimization.memory.mlp_chunk_tokens: %s has no Linear-GELU(tanh)-Linear MLP "
                "to chunk; nothing changed.",
                type(model).__name__,
            )
    budget_policy = ac.enabled and ac.policy == "memory_budget"
    report = MemoryReport(
        policy=ac.policy,
        memory_budget=ac.memory_budget if budget_policy else None,
        chunked_mlps=chunked,
    )
    checkpointing = ac.enabled and not budget_policy  # memory_budget: compile_blocks recomputes
    if not checkpointing and not memory.activation_offload:
        return report
    auto = checkpointing and ac.selective_ratio == "auto"
    budget = None if ac.memory_budget_gib is None else int(ac.memory_budget_gib * 2**30)
    if auto and budget is None and device is not None and torch.device(device).type == "cpu":
        raise ValueError(
            "optimization.memory.activation_checkpoint.selective_ratio: auto takes a fraction of "
            "the device's memory, and a cpu has none to measure; set memory_budget_gib."
        )
    if ac.target_paths:
        report.candidates = list(ac.target_paths)
    else:
        report.candidates = list(candidates) if candidates is not None else repeated_blocks(model)
    if not checkpointing:
        checkpointed: list[str] = []
    elif auto:
        checkpointed = list(report.candidates)
    else:
        checkpointed = select_evenly(report.candidates, ac.selective_ratio)
    offloaded = report.candidates[:-1] if memory.activation_offload and not auto else []
    report.offloader = ActivationOffloader() if memory.activation_offload else None
    # Static choices wrap only the blocks they change; auto may switch any candidate.
    paths = (
        report.candidates
        if auto
        else [p for p in report.candidates if p in checkpointed or p in offloaded]
    )
    blocks = wrap_blocks(
        model,
        paths,
        checkpointed=checkpointed,
        offloaded=offloaded,
        policy=ac.policy if checkpointing else "block",
        offloader=report.offloader,
        inside_compile=ac.inside_compile,
    )
    report.checkpointed, report.offloaded = checkpointed, offloaded
    if auto and blocks:
        in_flight = report.offloader.blocks_in_flight if report.offloader else BLOCKS_IN_FLIGHT
        report.planner = BudgetChooser(
            blocks,
            budget_bytes=budget,
            budget_fraction=ac.memory_budget_fraction,
            may_offload=memory.activation_offload,
            blocks_in_flight=in_flight,
            on_plan=report._planned,
        )
    return report


def __getattr__(name: str) -> Any:
    # Earlier names of this module's classes and functions, with a warning naming the new one.
    from litegen.utils.moved_modules import renamed_attribute

    return renamed_attribute(__name__, name)
