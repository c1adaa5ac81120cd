"""One model through ``prepare``, in the order docs/architecture.md gives and explains.

Casts and module swaps for every model; for a trained one, FP8 storage of a LoRA base's frozen
weights, FP8 training, the EMA template, the sequence-parallel hooks, block swap, checkpointing
and offload, compile, then the strategy's wrap. A frozen model gets the strategy's frozen wrap
only. :class:`litegen.runtime.litegen.LiteGen` sorts a ``prepare`` call's arguments and hands
each model here.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from litegen.lora import has_adapters
from litegen.memory import BlockSwap, MemoryReport, apply_memory_optimizations
from litegen.parallel import ParallelPlan
from litegen.parallel.base import Strategy
from litegen.precision.dtypes import cast_model
from litegen.precision.fp8_training import apply_fp8_training
from litegen.precision.fp8_weights import store_frozen_linears_in_fp8
from litegen.runtime.prepare import PreparedModel

if TYPE_CHECKING:
    from litegen.parallel.mesh import SequenceGroups

log = logging.getLogger("litegen")


class ModelPipeline:
    """Prepares one job's models; makes the sequence-parallel group and says warnings once.

    ``LiteGen`` keeps one and calls :meth:`prepare` for each model of a ``prepare`` call.

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

    def prepare(
        self,
        model: nn.Module,
        strategy: Strategy,
        optimization: Any,
        *,
        trained: bool,
        lab: Any = None,
        ema_copy: bool = False,
    ) -> PreparedModel:
        """``model`` prepared under ``optimization`` (an ``OptimizationConfig``).

        ``lab`` is the experimental features' :class:`litegen.experimental.Lab`, if any;
        ``ema_copy``: keep an unwrapped copy for an EMA that is a wrapped copy (fsdp1).
        """
        precision = optimization.precision
        if precision.cast_model:
            cast_model(model, precision.cast_model, precision.cast_exclude_paths)
        if optimization.kernels.fused_layernorm:
            from litegen.kernels import apply_fused_layernorm

            apply_fused_layernorm(model)
        if lab is not None:
            lab.swap_modules(model)
        if not trained:
            return PreparedModel(strategy.wrap_frozen_model(model), strategy, trainable=False)
        lora = optimization.lora
        if lora is not None and lora.fp8_base is not None and has_adapters(model):
            # After cast_model (the layers dequantise to the cast dtype), before the wrap moves
            # the model to the device.
            stored = store_frozen_linears_in_fp8(model, lora.fp8_base)
            log.info("%s: %d frozen Linear weights in fp8", type(model).__name__, len(stored))
        if precision.fp8_linear is not None:  # after fp8_base: its layers are not nn.Linear
            converted = apply_fp8_training(model, precision.fp8_linear, self.device)
            log.info("%s: %d Linear layers train in fp8", type(model).__name__, converted)
        # Taken before checkpointing and compile touch the blocks: the EMA copy only holds
        # weights and never runs forward.
        template = copy.deepcopy(model) if ema_copy else None
        if strategy.plan.seq_size > 1:
            self._apply_sequence_parallel(model, strategy.plan)
        # Block swap patches the blocks' forward first, so that checkpointing wraps it and its
        # recompute fetches the weights again (litegen/memory/block_swap.py).
        swap = None
        if optimization.memory.block_swap is not None:
            swap = BlockSwap(model, optimization.memory.block_swap.blocks_on_device, self.device)
        # Checkpointing patches blocks in place before the strategy wraps (or shards) them.
        memory = apply_memory_optimizations(
            model,
            optimization.memory,
            candidates=strategy.checkpoint_candidates(model),
            device=self.device,
        )
        self._warn_inert_checkpointing(model, optimization, memory)
        # policy memory_budget without compile was refused with the config (config/checks).
        if memory.candidates or memory.memory_budget is not None or memory.chunked_mlps:
            log.info("%s: %s", type(model).__name__, memory.describe())
        from litegen.compile import compile_blocks, compile_wanted

        if compile_wanted(optimization.compile, self.device, optimization.memory):
            # After checkpointing (compiled inside each block's BlockForward) and before the
            # wrap, so FSDP's hooks stay outside the compiled regions (litegen/compile.py).
            compiled = compile_blocks(
                model,
                optimization.compile,
                memory_budget=memory.memory_budget,
                block_contexts=_compiled_block_contexts(strategy, lab),
            )
            log.info("%s: compiled %d block(s)", type(model).__name__, len(compiled))
        wrapped = strategy.wrap_model(model)
        if swap is not None:  # the model is on the device once, wrapped; now move out
            swap.to_host()
            memory.block_swap = swap
            log.info(
                "%s: block swap: frozen weights of %d of %d blocks in host memory",
                type(model).__name__,
                len(swap.swapped),
                len(swap.blocks),
            )
        return PreparedModel(
            wrapped, strategy, trainable=True, ema_template=template, memory=memory
        )

    def _warn_inert_checkpointing(
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

    def _apply_sequence_parallel(self, model: nn.Module, parallel_plan: ParallelPlan) -> None:
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


def _compiled_block_contexts(strategy: Strategy, lab: Any) -> list[Any]:
    """What each compiled block enters around its calls (``compile_blocks``)."""
    contexts = []
    if strategy.plan.seq_size > 1:
        from litegen.parallel.sequence import compile_context

        contexts.append(compile_context)
    if lab is not None:
        contexts += lab.block_contexts()
    return contexts


__all__ = ["ModelPipeline"]
