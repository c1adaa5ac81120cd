"""The ``forward`` LiteGen installs on a candidate block: checkpointed or not, offloaded or not.

:class:`BlockForward` replaces ``block.forward`` on the instance (not the class, and without a
wrapper module), so parameter names, ``state_dict`` keys and ``named_modules`` stay the user's,
and module hooks (FSDP's all-gathers) run outside it. Its two switches, ``checkpoint`` and
``offload``, are read at every call: the budget planner (:mod:`litegen.memory.budget`) sets them
after the first step without touching the model again.

Layers of one call, outermost first:

1. the offloader's saved-tensor hooks (``offload``), always eager: hooks entered inside a
   compiled region break its graph, while hooks around a compiled block see the saved tensors
   of its compiled autograd function, which is exactly what the block keeps for backward;
2. non-reentrant ``torch.utils.checkpoint`` (``checkpoint``), either inside the compiled region
   (``inside_compile``: compile's partitioner plans the recompute and op-level policies apply)
   or outside it, around the compiled block (``checkpoint_wrapper(compiled_block)``'s order);
3. the block's own ``forward``, compiled by :func:`litegen.compile.compile_blocks` through
   :meth:`BlockForward.compile`: one compiled callable per mode (plain, checkpointed), so
   switching modes selects a graph instead of recompiling.

Under ``torch.no_grad()`` (sampling, EMA evaluation) the block runs plainly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _call_split(forward: Callable, n_args: int, names: tuple[str, ...], *flat: Any) -> Any:
    return forward(*flat[:n_args], **dict(zip(names, flat[n_args:], strict=True)))


def checkpointed_call(
    forward: Callable, context_fn: Callable | None, args: tuple, kwargs: dict[str, Any]
) -> Any:
    """``forward(*args, **kwargs)`` under non-reentrant checkpoint (with ``context_fn``, if any).

    Keyword arguments go to checkpoint positionally: checkpoint saves its positional tensors
    through saved-tensor hooks (where the offloader sees them) but would keep keyword tensors in
    a closure, out of the offloader's reach.

    Example:
        >>> block = nn.Bilinear(8, 4, 8)
        >>> x, c = torch.randn(2, 8, requires_grad=True), torch.randn(2, 4)
        >>> checkpointed_call(lambda x, cond: block(x, cond), None, (x,), {"cond": c}).shape
        torch.Size([2, 8])
    """
    options: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        options["context_fn"] = context_fn
    if not kwargs:
        return checkpoint(forward, *args, **options)
    run = functools.partial(_call_split, forward, len(args), tuple(kwargs))
    return checkpoint(run, *args, *kwargs.values(), **options)


class BlockForward:
    """Replaces a candidate block's ``forward``; ``checkpoint`` and ``offload`` switch per call.

    Example:
        >>> block = nn.Linear(8, 8)
        >>> block.forward = BlockForward(block.forward, checkpoint=True)
        >>> block(torch.randn(2, 8)).shape  # its activations are recomputed in backward
        torch.Size([2, 8])
        >>> block.forward.checkpoint = False  # from the next call on, the block runs plainly
    """

    def __init__(
        self,
        forward: Callable,
        *,
        module: nn.Module | None = None,
        checkpoint: bool = False,
        offload: bool = False,
        context_fn: Callable | None = None,
        offloader: Any = None,
        inside_compile: bool = True,
    ) -> None:
        if offload and offloader is None:
            raise ValueError("BlockForward(offload=True) needs the offloader that moves tensors.")
        self.original = forward  # the block's own bound forward
        self.module = module if module is not None else forward.__self__  # the block
        self.checkpoint = checkpoint
        self.offload = offload
        self.context_fn = context_fn
        self.offloader = offloader
        self.inside_compile = inside_compile
        self.meter: Any = None  # the budget planner while it measures the first step
        # True during the planner's extra plain run of the first step, which only counts what
        # the block saves (block swap borrows its weights for it instead of moving on).
        self.counting = False
        # What runs in each mode; compile() swaps in compiled callables.
        self.plain: Callable = forward
        self.checkpointed: Callable = self._checkpoint_original
        self.compiled = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # inference/EMA: nothing to save, nothing to recompute
            return self.plain(*args, **kwargs)
        if self.meter is not None:
            return self.meter.call(self, args, kwargs)
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """One training call in the current mode."""
        call = self.checkpointed if self.checkpoint else self.plain
        if self.offload:
            with self.offloader.block(self):
                return call(*args, **kwargs)
        return call(*args, **kwargs)

    def _checkpoint_original(self, *args: Any, **kwargs: Any) -> Any:
        return checkpointed_call(self.original, self.context_fn, args, kwargs)

    def _checkpoint_compiled(self, *args: Any, **kwargs: Any) -> Any:
        return checkpointed_call(self.plain, self.context_fn, args, kwargs)

    def compile(self, compile_fn: Callable[[Callable], Callable]) -> None:
        """Compile the callables each mode runs with ``compile_fn`` (``compile_blocks`` does).

        Example:
            >>> block = nn.Linear(8, 8)
            >>> block.forward = BlockForward(block.forward)
            >>> block.forward.compile(lambda fn: torch.compile(fn, backend="eager"))
            >>> block(torch.randn(2, 8)).shape
            torch.Size([2, 8])
        """
        self.plain = compile_fn(self.original)
        if self.inside_compile:
            self.checkpointed = compile_fn(self._checkpoint_original)
        else:
            self.checkpointed = self._checkpoint_compiled
        self.compiled = True

    def uncompile(self) -> None:
        """Back to the eager callables."""
        self.plain, self.checkpointed = self.original, self._checkpoint_original
        self.compiled = False


def block_forward(module: nn.Module) -> BlockForward | None:
    """The :class:`BlockForward` installed on ``module``, if any."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, BlockForward) else None
