"""Block swap: the frozen weights of a model's repeated blocks wait in host memory between uses.

Under LoRA the base weights never change, so all but ``blocks_on_device`` blocks keep their
frozen parameters in pinned host memory and get device copies only while they run:

* forward: each block's ``forward`` (patched on the instance, so activation checkpointing wraps
  it and its recompute fetches the weights again) puts device copies of the block's frozen
  parameters in place of the host ones, runs, and puts the host ones back. Before it runs, the
  next block's copies start on a side stream (the next one in the direction of travel: forward
  order in the forward, backward order in a checkpoint's recompute). The budget planner's
  counting run of a block (:mod:`litegen.memory.budget`) borrows the copies its own call then
  takes, and starts nothing;
* backward: a block that is not checkpointed saves its weights for backward through
  ``saved_tensors_hooks`` as handles; the first unpack of a block's weights fetches that block
  (prefetched when the block after it was unpacked) and starts the one before it.

So the device holds the resident blocks, the block running and the one being fetched. Trainable
parameters (the adapters) never move. On CUDA the copies come from pinned memory on a side stream
and the compute stream waits only on events; on a CPU the same code copies synchronously, and
:class:`SwapStats` counts what moved either way.

The model must fit on the device once: ``prepare`` moves it there to wrap it, then
:meth:`BlockSwap.to_host` moves the swapped blocks' frozen weights out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import _disable_current_modes

from litegen.memory.block_forward import block_forward
from litegen.model_parts.blocks import repeated_blocks


@dataclass
class SwapStats:
    """What a :class:`BlockSwap` moved to the device, counted per block fetch."""

    fetches: int = 0  # blocks copied to the device (forward, recompute or backward)
    prefetched: int = 0  # of those, copies started ahead of use
    bytes_streamed: int = 0


@dataclass(frozen=True)
class _Handle:
    """A saved weight, by block and position, with the view autograd saved of it."""

    block: int
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class BlockSwap:
    """Streams the frozen weights of ``model``'s repeated blocks after the first
    ``blocks_on_device`` from host memory.

    Example::

        swap = BlockSwap(model, blocks_on_device=2, device=torch.device("cuda"))
        model = strategy.wrap_model(model)  # the whole model on the device once
        swap.to_host()  # the other blocks' frozen weights now wait in pinned memory
        loss_fn(model, batch).backward(); swap.stats.fetches
    """

    def __init__(self, model: nn.Module, blocks_on_device: int, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors report their index; saved tensors are matched by device.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.paths = repeated_blocks(model)
        self.blocks = [model.get_submodule(p) for p in self.paths]
        self.resident = min(blocks_on_device, len(self.blocks))
        # Per swapped block: (owner module, parameter name) of each frozen parameter it holds,
        # and those parameters, whose data waits in host memory (set by to_host).
        self._slots: dict[int, list[tuple[nn.Module, str]]] = {}
        self._host: dict[int, list[nn.Parameter]] = {}
        self._pending: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self._unpacked: dict[int, list[torch.Tensor]] = {}
        self._storage_of: dict[int, tuple[int, int]] = {}  # storage pointer -> (block, index)
        self._last = -1
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.stats = SwapStats()
        for i, block in enumerate(self.blocks):
            block.forward = functools.partial(self._run, i, block.forward)

    @property
    def swapped(self) -> list[str]:
        """Paths of the blocks whose frozen weights wait in host memory."""
        return self.paths[self.resident :]

    def to_host(self) -> None:
        """Move the swapped blocks' frozen weights to (pinned) host memory, once wrapped."""
        pin = self.device.type == "cuda"
        for i in range(self.resident, len(self.blocks)):
            self._slots[i] = [
                (owner, name)
                for owner in self.blocks[i].modules()
                for name, p in owner.named_parameters(recurse=False)
                if not p.requires_grad
            ]
            self._host[i] = [owner._parameters[name] for owner, name in self._slots[i]]
            for param in self._host[i]:
                # In place: a wrapper (DDP) that lists the parameter then holds the host copy.
                host = param.detach().to("cpu", copy=True)
                param.data = host.pin_memory() if pin else host

    # -- fetching -----------------------------------------------------------------------------
    def _copy(self, i: int, on_side: bool) -> list[torch.Tensor]:
        self.stats.fetches += 1
        self.stats.prefetched += on_side
        self.stats.bytes_streamed += sum(t.numel() * t.element_size() for t in self._host[i])
        return [p.detach().to(self.device, non_blocking=True, copy=True) for p in self._host[i]]

    def _prefetch(self, i: int) -> None:
        if i not in self._host or i in self._pending or i in self._unpacked:
            return
        if self._stream is None:  # a CPU: copy now, with the same bookkeeping
            self._pending[i] = (self._copy(i, True), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            copies = self._copy(i, True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending[i] = (copies, event)

    def _fetch(self, i: int, keep: bool = False) -> list[torch.Tensor]:
        """Block ``i``'s device copies, ready on the current stream; ``keep`` leaves them pending
        for the next call."""
        if i not in self._pending:
            copies = self._copy(i, False)
            if keep:
                self._pending[i] = (copies, None)  # made on the current stream: nothing to wait on
            return copies
        copies, event = self._pending[i] if keep else self._pending.pop(i)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in copies:  # allocated on the side stream, freed after compute's use
                t.record_stream(current)
        return copies

    def _travel(self, i: int) -> None:
        """Start the next block in the direction of travel (forward or backward order)."""
        step = 1 if i > self._last else -1
        self._last = i
        if 0 <= i + step < len(self.blocks):
            self._prefetch(i + step)

    # -- forward and backward -------------------------------------------------------------------
    def _run(self, i: int, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        wrapper = block_forward(self.blocks[i])
        # The budget planner's counting run repeats the call that follows it: it borrows the
        # prefetched copies and leaves the direction of travel to that call.
        counting = wrapper is not None and wrapper.counting
        if i == 0 and not counting:  # a new forward (or block 0's recompute): travel restarts
            self._unpacked.clear()
            self._last = -1
        # Outside dispatch modes: selective checkpointing's mode matches a recompute's ops one
        # by one to its forward's, and the copies are no part of the block (a recompute
        # prefetches other blocks than its forward did).
        with _disable_current_modes():
            if not counting:
                self._travel(i)
            copies = self._fetch(i, keep=counting) if i in self._host else None
        if copies is None:
            return forward(*args, **kwargs)
        slots = self._slots[i]
        for (owner, name), copy in zip(slots, copies, strict=True):
            owner._parameters[name] = nn.Parameter(copy, requires_grad=False)
        # A checkpointed block saves nothing in its forward and keeps its recompute's copies
        # until its backward is done; another block saves its weights as handles. The counting
        # run saves plain tensors, for the planner's hooks to see (and to tell from parameters).
        handles = torch.is_grad_enabled() and not (
            wrapper is not None and (wrapper.checkpoint or counting)
        )
        try:
            if not handles:
                return forward(*args, **kwargs)
            self._storage_of = {
                t.untyped_storage().data_ptr(): (i, k) for k, t in enumerate(copies)
            }
            with saved_tensors_hooks(self._pack, self._unpack):
                return forward(*args, **kwargs)
        finally:
            self._storage_of = {}
            for (owner, name), host in zip(slots, self._host[i], strict=True):
                owner._parameters[name] = host

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device != self.device or type(tensor) not in (torch.Tensor, nn.Parameter):
            return tensor
        owner = self._storage_of.get(tensor.untyped_storage().data_ptr())
        if owner is None:
            return tensor
        return _Handle(*owner, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Handle):
            return saved
        copies = self._unpacked.get(saved.block)
        if copies is None:
            copies = self._fetch(saved.block)
            # Only the block being differentiated keeps its copies; the one before it starts.
            self._unpacked = {saved.block: copies}
            self._travel(saved.block)
        base = copies[saved.index]
        return base.as_strided(saved.size, saved.stride, saved.offset)
