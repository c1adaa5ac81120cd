"""One model through ``prepare``: the steps of :data:`litegen.runtime.steps.MODEL_STEPS`, in order.

:class:`litegen.runtime.litegen.LiteGen` sorts a ``prepare`` call's arguments and hands each
model here; the steps' order, and why, is in ``runtime/steps.py`` and docs/architecture.md.
What the steps share across one job's models (the sequence-parallel groups, a warning said
once) lives on the :class:`ModelPipeline`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from litegen.memory import MemoryReport
from litegen.parallel import ParallelPlan
from litegen.parallel.base import Strategy
from litegen.runtime.prepare_arguments import PreparedModel
from litegen.runtime.steps import StepContext, run_steps

if TYPE_CHECKING:
    from litegen.parallel.mesh import SequenceGroups

log = logging.getLogger("litegen")


class ModelPipeline:
    """Prepares one job's models; makes the sequence-parallel group and says warnings once.

    ``LiteGen`` keeps one and calls :meth:`run` for each model of a ``prepare`` call.

    Example:
        >>> pipeline = ModelPipeline(torch.device("cpu"), is_main_process=True)
        >>> pipeline.device
        device(type='cpu')
    """

    def __init__(self, device: torch.device, is_main_process: bool) -> None:
        self.device = device
        self.is_main_process = is_main_process
        self._sp_groups: SequenceGroups | None = None  # made at the first split model
        self._warned_inert = False  # activation checkpointing of no block, said once

    def run(
        self,
        model: nn.Module,
        strategy: Strategy,
        optimization: Any,
        *,
        trained: bool,
        lab: Any = None,
        ema_copy: bool = False,
    ) -> PreparedModel:
        """``model`` through the model steps under ``optimization`` (an ``OptimizationConfig``).

        ``lab`` is the experimental features' :class:`litegen.experimental.Lab`, if any;
        ``ema_copy``: keep an unwrapped copy for an EMA that is a wrapped copy (fsdp1).
        """
        ctx = StepContext(
            model,
            optimization,
            trained=trained,
            device=self.device,
            strategy=strategy,
            pipeline=self,
            lab=lab,
            ema_copy=ema_copy,
        )
        run_steps(ctx)
        return PreparedModel(
            ctx.model,
            strategy,
            trainable=trained,
            ema_template=ctx.ema_template,
            memory=ctx.memory,
        )

    def warn_inert_checkpointing(
        self, model: nn.Module, optimization: Any, memory: MemoryReport
    ) -> None:
        """Once per job, on rank 0: checkpointing is on and checkpoints no block (the config's
        own warning said so when it loaded; this names the model and its block count)."""
        inert = optimization.memory.activation_checkpoint.checkpoints_nothing()
        if inert is None or not memory.candidates or self._warned_inert:
            return
        self._warned_inert = True
        if self.is_main_process:
            log.warning(
                "%s: activation checkpointing of 0 of %d blocks. %s",
                type(model).__name__,
                len(memory.candidates),
                inert,
            )

    def apply_sequence_parallel(self, model: nn.Module, parallel_plan: ParallelPlan) -> None:
        """Install the model's sequence-parallel plan, before checkpointing, compile and wrap.

        Its split and gather are hooks on module calls, which run outside the blocks' patched
        ``forward`` (checkpoint, compile): a checkpointed block saves only its shard of the
        sequence, and the collectives at the block boundaries stay out of compiled graphs. Its
        attention wrappers sit inside the blocks, where recomputation and compile see them.
        The plan names the user's module paths, before a wrapper renames them.
        """
        from litegen.parallel.mesh import sequence_groups
        from litegen.parallel.sequence import apply_sequence_parallel, plan_for

        if self._sp_groups is None:
            self._sp_groups = sequence_groups(parallel_plan)
        groups = self._sp_groups
        apply_sequence_parallel(
            model,
            plan_for(model),
            groups.sequence,
            ulysses_group=groups.ulysses,
            ring_group=groups.ring,
        )
        log.info(
            "%s: sequence parallel over %d ranks (Ulysses %d x ring %d; data parallel over %d "
            "groups)",
            type(model).__name__,
            parallel_plan.seq_size,
            parallel_plan.sp_size,
            parallel_plan.cp_size,
            parallel_plan.dp_size,
        )


__all__ = ["ModelPipeline"]
