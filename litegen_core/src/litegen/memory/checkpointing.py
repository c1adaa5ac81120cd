"""Selective activation checkpointing of a model's blocks (non-reentrant ``torch.utils.checkpoint``).

A checkpointed block keeps only its inputs during the forward pass and runs its forward again
in the backward pass. The block's ``forward`` is replaced on the instance by a
:class:`litegen.memory.block_forward.BlockForward` (no wrapper module), so parameter names,
``state_dict`` keys and ``named_modules`` stay exactly those of the user's model (checkpoints,
optimizers and FSDP plans keep working), and module hooks (FSDP's all-gathers) still run outside
the recomputed region, as with torchtitan's wrapper.

``selective_ratio`` is the share of candidate blocks left *without* checkpointing. The
``k = n - round(ratio * n)`` checkpointed blocks are spread evenly through the depth with
Bresenham's rule: block ``i`` is checkpointed when ``floor((i + 1) k / n) > floor(i k / n)``, so
each stretch of ``n / k`` blocks ends with a checkpointed one (4 blocks at 0.5: blocks 1 and 3;
28 blocks at 0.25: every block but 0, 4, 8, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from litegen.config.memory import blocks_to_checkpoint
from litegen.memory.block_forward import BlockForward, block_forward
from litegen.model_parts.paths import submodules_at

aten = torch.ops.aten

# Outputs kept by the ``ops_all`` policy: the expensive ops (matmuls, attention, convolutions);
# ``ops`` keeps them too, but for the widening linear layers.
# Everything else in a checkpointed block (norms, activations, adds, modulation) is recomputed,
# which costs little time but frees most of the block's activation memory.
_SAVED_OPS_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
SAVED_OPS = frozenset(
    getattr(aten, name).default for name in _SAVED_OPS_NAMES if hasattr(aten, name)
)


# The ops linear layers lower to, and where their two matrix operands sit in the arguments.
# Batched matmuls (bmm, baddbmm) are left out: in a block they are attention written by hand,
# whose scores are wide but far from cheap to recompute.
_LINEAR_OPERANDS = {"mm": 0, "_scaled_mm": 0, "addmm": 1}
LINEAR_OPERANDS = {
    getattr(aten, name).default: first
    for name, first in _LINEAR_OPERANDS.items()
    if hasattr(aten, name)
}
# ``ops`` recomputes linear layers whose output is at least this many times wider than their
# input: a DiT/ViT MLP's up-projection (4x), the widest activation of a block.
RECOMPUTE_WIDENING = 4


def _keep_expensive_ops(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def ops_all_policy_context() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint``: save matmul/attention outputs, recompute the rest.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> block, x = nn.Linear(8, 32), torch.randn(2, 8, requires_grad=True)
        >>> checkpoint(block, x, use_reentrant=False, context_fn=ops_all_policy_context).shape
        torch.Size([2, 32])
    """
    return create_selective_checkpoint_contexts(_keep_expensive_ops)


def _widening(func: Any, args: tuple) -> float:
    """How many times wider a linear layer's output rows are than its input rows (N / K)."""
    first = LINEAR_OPERANDS[func]
    a, b = args[first], args[first + 1]
    return b.shape[-1] / a.shape[-1]


def _keep_all_but_widening_linears(
    ctx: Any, func: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    if func in LINEAR_OPERANDS and _widening(func, args) >= RECOMPUTE_WIDENING:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return _keep_expensive_ops(ctx, func, *args, **kwargs)


def ops_policy_context() -> tuple[Any, Any]:
    """Like :func:`ops_all_policy_context`, but also recomputes the widening linear layers.

    A linear layer (``mm``/``addmm``) whose output is at least ``RECOMPUTE_WIDENING`` (4)
    times wider than its input is recomputed: in DiT and ViT blocks that is the MLP's
    up-projection, whose output is the largest activation of the block. Recomputing it costs
    one matmul per block and frees about a third of what keeping every matmul output holds.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> block, x = nn.Linear(8, 32), torch.randn(2, 8, requires_grad=True)
        >>> checkpoint(block, x, use_reentrant=False, context_fn=ops_policy_context).shape
        torch.Size([2, 32])
    """
    return create_selective_checkpoint_contexts(_keep_all_but_widening_linears)


# policy name -> context_fn (``block`` needs none: everything is recomputed)
POLICY_CONTEXTS: dict[str, Callable[[], tuple[Any, Any]] | None] = {
    "block": None,
    "ops": ops_policy_context,
    "ops_all": ops_all_policy_context,
}


def select_evenly(paths: Sequence[str], selective_ratio: float) -> list[str]:
    """The candidates to checkpoint: all but ``round(ratio * n)``, evenly spread (module doc).

    Example:
        >>> select_evenly(["b.0", "b.1", "b.2", "b.3"], 0.5)
        ['b.1', 'b.3']
    """
    if not 0.0 <= selective_ratio <= 1.0:
        raise ValueError(
            f"activation_checkpoint.selective_ratio={selective_ratio} must lie in [0, 1] "
            "(0: checkpoint every block, 1: none)."
        )
    n = len(paths)
    return spread_evenly(paths, blocks_to_checkpoint(selective_ratio, n))


def spread_evenly(paths: Sequence[str], k: int) -> list[str]:
    """``k`` of the ``paths``, evenly spread through them (Bresenham's rule, module doc).

    Example:
        >>> spread_evenly(["b.0", "b.1", "b.2", "b.3"], 1)
        ['b.3']
    """
    n = len(paths)
    return [p for i, p in enumerate(paths) if (i + 1) * k // n > i * k // n]


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` runs checkpointed (now; the budget planner may switch it)."""
    forward = block_forward(module)
    return forward is not None and forward.checkpoint


def wrap_blocks(
    model: nn.Module,
    paths: Sequence[str],
    *,
    checkpointed: Sequence[str] = (),
    offloaded: Sequence[str] = (),
    policy: str = "block",
    offloader: Any = None,
    inside_compile: bool = True,
) -> dict[str, BlockForward]:
    """Install a :class:`BlockForward` on each module at ``paths``; returns them by path.

    Those in ``checkpointed`` run checkpointed with ``policy``; those in ``offloaded`` hand what
    they save to ``offloader``. A module prepared before keeps its forward (never nested).

    Example:
        >>> dit = nn.Module()
        >>> dit.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        >>> wrap_blocks(dit, ["blocks.0", "blocks.1"], checkpointed=["blocks.1"]).keys()
        dict_keys(['blocks.0', 'blocks.1'])
    """
    if policy not in POLICY_CONTEXTS:
        raise ValueError(
            f"activation_checkpoint.policy '{policy}' is unknown; use one of "
            f"{', '.join(POLICY_CONTEXTS)}."
        )
    check_paths(model, paths)
    context_fn = POLICY_CONTEXTS[policy]
    wrapped: dict[str, BlockForward] = {}
    for path in paths:
        module = model.get_submodule(path)
        forward = block_forward(module)
        if forward is None:  # prepared twice: keep the first wrapping
            forward = BlockForward(
                module.forward,
                module=module,
                checkpoint=path in checkpointed,
                offload=path in offloaded,
                context_fn=context_fn,
                offloader=offloader,
                inside_compile=inside_compile,
            )
            module.forward = forward
        wrapped[path] = forward
    return wrapped


def checkpoint_modules(
    model: nn.Module,
    paths: Sequence[str],
    *,
    policy: str = "block",
    offloader: Any = None,
) -> list[str]:
    """Checkpoint the submodules at ``paths`` in place; returns the paths patched.

    ``policy="ops_all"`` keeps matmul and attention outputs inside each block (selective
    checkpoint contexts); ``"ops"`` recomputes the widening linear layers (MLP up-projections) too.
    With an ``offloader`` (:class:`litegen.memory.offload.ActivationOffloader`), the inputs each
    block saves go to host memory until the backward pass needs them.

    Example:
        >>> dit = nn.Module()
        >>> dit.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        >>> checkpoint_modules(dit, ["blocks.1", "blocks.3"])
        ['blocks.1', 'blocks.3']
    """
    offloaded = paths if offloader is not None else ()
    wrap_blocks(
        model, paths, checkpointed=paths, offloaded=offloaded, policy=policy, offloader=offloader
    )
    return list(paths)


def check_paths(model: nn.Module, paths: Sequence[str]) -> None:
    """Raise ``ValueError`` for unknown paths, the root, or paths nested inside one another."""
    submodules_at(model, paths, "optimization.memory.activation_checkpoint.target_paths")
    if "" in paths:
        raise ValueError("the root module cannot be checkpointed; list its blocks instead.")
    nested = [(a, b) for a in paths for b in paths if b.startswith(a + ".")]
    if nested:
        raise ValueError(
            f"activation checkpoint paths are nested {nested}; list either the outer or the "
            "inner modules, not both."
        )
