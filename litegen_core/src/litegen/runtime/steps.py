"""The steps ``prepare`` takes with each model, in order: :data:`MODEL_STEPS` is the one list.

Each :class:`Step` names itself, says when it applies and what it does to the model. The order
is the design (docs/architecture.md repeats this list and explains it):

* casts and module swaps run on every model; a frozen model then goes straight to the wrap;
* FP8 storage of a LoRA base's frozen weights comes after the cast (its layers dequantise to
  the cast dtype), and FP8 training after it (FP8-stored layers are no longer ``nn.Linear``);
* the EMA template is copied before anything patches the blocks (it only holds weights);
* the sequence-parallel split and gather are hooks at the block boundaries, outside what the
  later steps patch; the plan names the user's module paths, before a wrapper renames them;
* block swap's forwards go on the blocks before checkpointing wraps them, so a recomputed block
  fetches its weights again (litegen/memory/block_swap.py);
* checkpointing and offload patch a block's ``forward`` before compile sees it, so recompute
  runs inside the compiled graph; compile comes before the strategy's wrap, whose hooks (FSDP's
  all-gathers) stay outside compiled regions;
* block swap moves the swapped weights to host memory once the wrap has put the model on the
  device.

:class:`litegen.runtime.model_pipeline.ModelPipeline` runs the list for ``prepare``;
:func:`apply_estimate_steps` runs the steps that change what the model stores
(``in_estimate``) on the meta device, for the peak estimate.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from litegen.lora import apply_lora, has_adapters, train_adapters
from litegen.memory import BlockSwap, MemoryReport, apply_memory_optimizations
from litegen.precision.dtypes import cast_model
from litegen.precision.fp8_training import apply_fp8_training
from litegen.precision.fp8_weights import store_frozen_linears_in_fp8

if TYPE_CHECKING:
    from litegen.parallel.base import Strategy
    from litegen.runtime.model_pipeline import ModelPipeline

log = logging.getLogger("litegen")
META = torch.device("meta")  # where the estimator's models live


@dataclass
class StepContext:
    """One model on its way through the steps: what they read, and what they leave behind.

    ``optimization`` is an ``OptimizationConfig``; ``lab`` the experimental features'
    :class:`litegen.experimental.Lab`, if any; ``ema_copy``: keep an unwrapped copy for an EMA
    that is a wrapped copy (fsdp1). The estimator has no strategy and no pipeline.

    Example:
        >>> from litegen.config import OptimizationConfig
        >>> opt = OptimizationConfig(precision={"cast_model": "bf16"})
        >>> ctx = StepContext(nn.Linear(4, 4), opt, trained=True)
        >>> [step.name for step in ESTIMATE_STEPS if step.wanted(ctx)]
        ['cast_model']
    """

    model: nn.Module
    optimization: Any
    trained: bool
    device: torch.device = META
    strategy: Strategy | None = None
    pipeline: ModelPipeline | None = None
    lab: Any = None
    ema_copy: bool = False
    # Left by the steps, for later steps and the PreparedModel.
    ema_template: nn.Module | None = None
    block_swap: BlockSwap | None = None
    memory: MemoryReport | None = None

    @property
    def name(self) -> str:
        return type(self.model).__name__


@dataclass(frozen=True)
class Step:
    """One step of :data:`MODEL_STEPS`.

    ``trained_only``: frozen models skip it. ``in_estimate``: it changes what the model stores,
    so :func:`apply_estimate_steps` runs it too (on meta modules, without a strategy).
    """

    name: str
    applies: Callable[[StepContext], bool]
    run: Callable[[StepContext], None]
    trained_only: bool = True
    in_estimate: bool = False

    def wanted(self, ctx: StepContext) -> bool:
        return (ctx.trained or not self.trained_only) and self.applies(ctx)


# -- the steps, in the order of MODEL_STEPS -------------------------------------------------------
def _cast(ctx: StepContext) -> None:
    precision = ctx.optimization.precision
    cast_model(ctx.model, precision.cast_model, precision.cast_exclude_paths)


def _fused_layernorm(ctx: StepContext) -> None:
    from litegen.kernels import apply_fused_layernorm

    apply_fused_layernorm(ctx.model)


def _lab_swaps(ctx: StepContext) -> None:
    ctx.lab.swap_modules(ctx.model)


def _wants_fp8_base(ctx: StepContext) -> bool:
    lora = ctx.optimization.lora
    return lora is not None and lora.fp8_base is not None and has_adapters(ctx.model)


def _fp8_base(ctx: StepContext) -> None:
    stored = store_frozen_linears_in_fp8(ctx.model, ctx.optimization.lora.fp8_base)
    if ctx.strategy is not None:  # prepare says it; the estimator (no strategy) stays quiet
        log.info("%s: %d frozen Linear weights in fp8", ctx.name, len(stored))


def _fp8_linear(ctx: StepContext) -> None:
    fp8 = ctx.optimization.precision.fp8_linear
    converted = apply_fp8_training(ctx.model, fp8, ctx.device)
    log.info("%s: %d Linear layers train in fp8", ctx.name, converted)


def _ema_template(ctx: StepContext) -> None:
    ctx.ema_template = copy.deepcopy(ctx.model)


def _sequence_parallel(ctx: StepContext) -> None:
    ctx.pipeline.apply_sequence_parallel(ctx.model, ctx.strategy.plan)


def _block_swap(ctx: StepContext) -> None:
    blocks = ctx.optimization.memory.block_swap.blocks_on_device
    ctx.block_swap = BlockSwap(ctx.model, blocks, ctx.device)


def _memory_savers(ctx: StepContext) -> None:
    memory = apply_memory_optimizations(
        ctx.model,
        ctx.optimization.memory,
        candidates=ctx.strategy.checkpoint_candidates(ctx.model),
        device=ctx.device,
    )
    ctx.memory = memory
    ctx.pipeline.warn_inert_checkpointing(ctx.model, ctx.optimization, memory)
    # policy memory_budget without compile was refused with the config (config/checks).
    if memory.candidates or memory.memory_budget is not None or memory.chunked_mlps:
        log.info("%s: %s", ctx.name, memory.describe())


def _wants_compile(ctx: StepContext) -> bool:
    from litegen.compile import compile_wanted

    optimization = ctx.optimization
    return compile_wanted(optimization.compile, ctx.device, optimization.memory)


def _compile(ctx: StepContext) -> None:
    from litegen.compile import compile_blocks

    compiled = compile_blocks(
        ctx.model,
        ctx.optimization.compile,
        memory_budget=ctx.memory.memory_budget,
        block_contexts=_compiled_block_contexts(ctx),
    )
    log.info("%s: compiled %d block(s)", ctx.name, len(compiled))


def _compiled_block_contexts(ctx: StepContext) -> list[Any]:
    """What each compiled block enters around its calls (``compile_blocks``)."""
    contexts = []
    if ctx.strategy.plan.seq_size > 1:
        from litegen.parallel.sequence import compile_context

        contexts.append(compile_context)
    if ctx.lab is not None:
        contexts += ctx.lab.block_contexts()
    return contexts


def _wrap(ctx: StepContext) -> None:
    strategy = ctx.strategy
    ctx.model = (
        strategy.wrap_model(ctx.model) if ctx.trained else strategy.wrap_frozen_model(ctx.model)
    )


def _swap_to_host(ctx: StepContext) -> None:
    swap = ctx.block_swap
    swap.to_host()
    ctx.memory.block_swap = swap
    log.info(
        "%s: block swap: frozen weights of %d of %d blocks in host memory",
        ctx.name,
        len(swap.swapped),
        len(swap.blocks),
    )


def _always(ctx: StepContext) -> bool:
    return True


MODEL_STEPS: tuple[Step, ...] = (
    Step(
        "cast_model",
        lambda ctx: bool(ctx.optimization.precision.cast_model),
        _cast,
        trained_only=False,
        in_estimate=True,
    ),
    Step(
        "fused_layernorm",
        lambda ctx: ctx.optimization.kernels.fused_layernorm,
        _fused_layernorm,
        trained_only=False,
    ),
    Step("lab_module_swaps", lambda ctx: ctx.lab is not None, _lab_swaps, trained_only=False),
    Step("fp8_base", _wants_fp8_base, _fp8_base, in_estimate=True),
    Step("fp8_linear", lambda ctx: ctx.optimization.precision.fp8_linear is not None, _fp8_linear),
    Step("ema_template", lambda ctx: ctx.ema_copy, _ema_template),
    Step("sequence_parallel", lambda ctx: ctx.strategy.plan.seq_size > 1, _sequence_parallel),
    Step("block_swap", lambda ctx: ctx.optimization.memory.block_swap is not None, _block_swap),
    Step("memory_savers", _always, _memory_savers),
    Step("compile", _wants_compile, _compile),
    Step("wrap", _always, _wrap, trained_only=False),
    Step("swap_to_host", lambda ctx: ctx.block_swap is not None, _swap_to_host),
)


def run_steps(ctx: StepContext, steps: tuple[Step, ...] = MODEL_STEPS) -> StepContext:
    """Run each of ``steps`` that ``ctx`` wants, in order; returns ``ctx``.

    Example:
        >>> from litegen.config import OptimizationConfig
        >>> opt = OptimizationConfig(precision={"cast_model": "bf16"})
        >>> ctx = StepContext(nn.Linear(4, 4), opt, trained=True)
        >>> run_steps(ctx, ESTIMATE_STEPS).model.weight.dtype
        torch.bfloat16
    """
    for step in steps:
        if step.wanted(ctx):
            log.debug("%s: prepare step %s", ctx.name, step.name)
            step.run(ctx)
    return ctx


# The steps that change what a model stores: the peak estimate runs them on meta modules.
ESTIMATE_STEPS: tuple[Step, ...] = tuple(step for step in MODEL_STEPS if step.in_estimate)


def apply_estimate_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, optimization: Any
) -> nn.Module:
    """What ``prepare`` changes in the stored weights of a trained model, with its own steps:
    LoRA adapters (and the optimizer rebound to them), then :data:`ESTIMATE_STEPS`
    (``cast_model``, ``fp8_base``).

    ``optimization`` is an ``OptimizationConfig``. Works on meta modules.

    Example:
        >>> from litegen.config import OptimizationConfig
        >>> net = nn.Linear(4, 4)
        >>> opt = OptimizationConfig(precision={"cast_model": "bf16"})
        >>> apply_estimate_steps(net, None, opt).weight.dtype
        torch.bfloat16
    """
    lora = optimization.lora
    if lora is not None:
        apply_lora(model, lora)
        if optimizer is not None:
            train_adapters(optimizer, model)
    return run_steps(StepContext(model, optimization, trained=True), ESTIMATE_STEPS).model


def __getattr__(name: str) -> Any:
    # Earlier names of this module's functions, with a warning naming the new one.
    from litegen.utils.moved_modules import renamed_attribute

    return renamed_attribute(__name__, name)


__all__ = [
    "ESTIMATE_STEPS",
    "MODEL_STEPS",
    "Step",
    "StepContext",
    "apply_estimate_steps",
    "run_steps",
]
