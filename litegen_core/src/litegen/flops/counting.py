"""Count a step's FLOPs with ``FlopCounterMode`` while compiled regions keep running compiled.

Compiled regions (:func:`litegen.compile.compile_blocks`) run compiled while counting, so the
counting step uses the memory, random numbers and kernels of every other step.
``FlopCounterMode`` cannot see inside a compiled graph (and, on the dispatch stack, would make
Dynamo run the region eagerly), so each call of a compiled region steps the counting aside
(:func:`call_compiled`): the region's eager ``forward``, with its backward where the call records
one, is counted on fake tensors (shapes only, no memory, no random numbers drawn), and the
counting stays aside while the region's own backward runs. The figure is the one an eager step
counts: eager ops, eager formulas; with activation checkpointing the recomputed forward counts
(outside the compiled region, the whole forward, which is what a compiled region recomputes).

Example:
    >>> model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    >>> with FlopCounter() as counter:
    ...     loss = model(x).mean(); loss.backward()
    >>> counter.flops  # forward 2*4*8*8, backward the same again for the weight's gradient
    1024
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

log = logging.getLogger("litegen")


class FlopCounter:
    """Counts the FLOPs of the code run inside it (matmuls, convolutions, attention).

    Compiled regions run compiled and are counted on fake tensors (module docstring);
    ``flops`` is ``None`` when one of them cannot run on fake tensors (a warning says which).
    One counter at a time.

    Example:
        >>> model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
        >>> with FlopCounter() as counter:
        ...     loss = model(x).mean(); loss.backward()
        >>> counter.flops > 0
        True
    """

    def __init__(self) -> None:
        self._mode = _CountingMode()
        self._compiled_flops: int | None = 0  # None once a compiled region could not be counted
        self.flops: int | None = 0

    def __enter__(self) -> FlopCounter:
        global _active
        if _active is not None:
            raise RuntimeError("FlopCounter is already counting; one counter at a time.")
        self._mode.__enter__()
        _active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        _active = None
        self._mode.__exit__(*exc)
        total = self._mode.flops
        self.flops = None if self._compiled_flops is None else total + self._compiled_flops

    def _call_compiled(
        self, compiled: Callable, eager: Callable, args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        # Inside a backward node (activation checkpointing outside the compiled region recomputes
        # the block there) eager code would run the forward alone, without a backward.
        training = torch.is_grad_enabled() and torch._C._current_autograd_node() is None
        if self._compiled_flops is not None:
            try:
                self._compiled_flops += _fake_flops(eager, args, kwargs, backward=training)
            except Exception as exc:  # an op without a fake kernel, or data-dependent code
                self._compiled_flops = None
                log.warning(
                    "cannot count the FLOPs of compiled %s on fake tensors (%s: %s); MFU is "
                    "left out of the logs. Give the model a flops_per_sample() method.",
                    getattr(eager, "__qualname__", eager),
                    type(exc).__name__,
                    exc,
                )
        with _disable_current_modes():
            first = _next_node_number() if training else 0
            out = compiled(*args, **kwargs)
        if training and first is not None:
            _hide_backward(out, first)
        return out


# The counter of the step now running: compiled regions called during it are counted aside.
_active: FlopCounter | None = None
_hidden = threading.local()  # per autograd thread: the modes a compiled backward set aside


def call_compiled(compiled: Callable, eager: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``compiled(*args, **kwargs)``; while a :class:`FlopCounter` counts, counted as ``eager``.

    ``eager`` is the region's uncompiled callable; it runs on fake tensors, so counting costs
    no memory and changes no result. :func:`litegen.compile.compile_blocks` calls its regions
    through this.

    Example::

        out = call_compiled(compiled_block, block.forward, (x,), {"c": c})
    """
    counter = _active
    if counter is None:
        return compiled(*args, **kwargs)
    return counter._call_compiled(compiled, eager, args, kwargs)


def _fake_flops(eager: Callable, args: tuple, kwargs: dict[str, Any], *, backward: bool) -> int:
    """FLOPs of ``eager(*args, **kwargs)`` (and its backward) run on fake copies of the inputs.

    Parameters stay real (no copy), so the backward returns their gradients through
    ``torch.autograd.grad`` instead of accumulating them; outer saved-tensor hooks (checkpoint,
    offload) are shadowed so they never see fake tensors, and autocast's cache of cast
    parameters is off, so a fake cast never reaches the real step's later forwards.
    """
    identity = torch.autograd.graph.saved_tensors_hooks(_same, _same)
    with (
        _disable_current_modes(),
        identity,
        _no_autocast_cache(),
        FakeTensorMode(allow_non_fake_inputs=True) as fake,
        _total_flop_counter() as counter,
    ):

        def to_fake(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            copy = fake.from_tensor(value.detach())
            return copy.requires_grad_() if backward and value.requires_grad else copy

        out = eager(*tree_map(to_fake, args), **tree_map(to_fake, kwargs))
        if backward:
            outputs = [
                t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if outputs:
                grads = [torch.ones_like(t) for t in outputs]
                leaves = _graph_leaves(outputs)  # parameters and the fake inputs
                torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    return int(counter.get_total_flops())


class _CountingMode(TorchDispatchMode):
    """Counts the ops of the real step as ``FlopCounterMode`` does, without touching results.

    ``FlopCounterMode`` runs an op it has no formula for through the op's decomposition when
    it has one (``silu_backward``, or ``linear`` under ``inference_mode``), which changes the
    op's rounding; here the op runs as always and only its decomposition is counted, on fake
    copies of the inputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        elif torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        ):
            self.flops += _fake_flops(func.decompose, args, kwargs, backward=False)
        return out


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """Autocast without its cache of cast parameters (it would keep casts of fake tensors)."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _total_flop_counter() -> FlopCounterMode:
    """``FlopCounterMode`` for the total only: without its per-module tracker.

    The tracker's global module hooks would also run inside compiled code (an ``aot_eager``
    graph is a module) and on the fake tensors, and its backward hooks refuse
    ``torch.autograd.grad``.
    """
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _TotalOnly()
    return counter


class _TotalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker: every op counts towards the total."""

    parents = ("Global",)

    def __enter__(self) -> _TotalOnly:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _graph_leaves(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (parameters, inputs) the autograd graph of ``outputs`` accumulates into."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[Node] = set()
    stack = [t.grad_fn for t in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None:
            leaves[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


def _next_node_number() -> int | None:
    """The sequence number the next autograd node created on this thread gets.

    ``None`` where this torch has no ``Node._sequence_nr`` (a private method, present in 2.8 to
    2.13): the compiled backward is then counted as it runs, and the figure may run high.
    """
    with torch.enable_grad():
        marker = torch.empty(0, requires_grad=True).view(-1)
    number = getattr(marker.grad_fn, "_sequence_nr", None)
    return number() + 1 if number is not None else None


def _hide_backward(out: Any, first: int) -> None:
    """Set the dispatch modes aside while the nodes a compiled call recorded run their backward.

    Those nodes are the ones reachable from ``out`` numbered ``first`` or later (created during
    the call); the backward they run is already counted (:func:`_fake_flops`), and inside a
    compiled graph the counter would see only some of it (inductor's library calls).
    Gradient accumulators (numbered last of all) are left alone.
    """
    seen: set[Node] = set()
    stack = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if not first <= node._sequence_nr() < _ACCUMULATOR_NUMBER:
            continue
        node.register_prehook(_set_modes_aside)
        node.register_hook(_restore_modes)
        stack.extend(next_node for next_node, _ in node.next_functions)


_ACCUMULATOR_NUMBER = 2**64 - 1  # AccumulateGrad nodes run as soon as they can


def _set_modes_aside(grad_outputs: Any) -> None:
    # The pre-hook, the node and its post-hook run on one thread in one go.
    stack = _hidden.__dict__.setdefault("stack", [])
    aside = _disable_current_modes()
    aside.__enter__()
    stack.append(aside)


def _restore_modes(grad_inputs: Any, grad_outputs: Any) -> None:
    _hidden.stack.pop().__exit__(None, None, None)


__all__ = ["FlopCounter", "call_compiled"]
