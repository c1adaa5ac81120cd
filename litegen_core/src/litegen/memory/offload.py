"""Activation offload: the inputs checkpointed blocks save go to CPU memory until backward.

Non-reentrant checkpoint keeps only a block's inputs, saving them through autograd's saved
tensor hooks; :class:`ActivationOffloader` installs ``saved_tensors_hooks`` around each
checkpointed call (inside it, checkpoint's own hooks take over), so it sees exactly those inputs.

On CUDA, forward copies each input into a pinned CPU buffer on a side stream (compute goes on;
``record_stream`` keeps the allocator from reusing the GPU memory before the copy has read it).
In backward, unpacking block ``i``'s inputs starts the copy back of block ``i - 1``'s inputs (the
next block in backward order) on a second side stream, so it overlaps block ``i``'s recompute and
backward; the compute stream waits on an event only when it needs the data.

Groups of saved inputs are kept per forward pass, never per block index: a forward ends when a
block is called again, so gradient accumulation and several forwards before one backward each
get their own prefetch chain. Pinned buffers return to a pool keyed by shape, strides and dtype
when autograd frees the saved tensor, and the next step reuses them.

On CPU the same code runs without streams (inputs are copied into separate buffers and copied
back), so CI tests the bookkeeping. Hooks may run on autograd's worker threads; forward and
backward of one model never run at the same time, so the counters need no lock.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks


@dataclass
class OffloadStats:
    """What the offloader did since it was created (or since :meth:`reset`)."""

    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    tensors_kept: int = 0  # saved where they were: parameters, tensor subclasses, tiny tensors
    tensors_prefetched: int = 0  # copied back ahead of need (while the next block computes)
    tensors_fetched_on_demand: int = 0  # copied back when needed: the first block of backward
    bytes_reloaded: int = 0
    buffers_allocated: int = 0
    buffers_reused: int = 0

    def reset(self) -> None:
        for name in asdict(self):
            setattr(self, name, 0)


class _Slot:
    """One pooled CPU buffer and the last copy event that touches it."""

    __slots__ = ("buffer", "event")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.event: torch.cuda.Event | None = None


class _BufferPool:
    """CPU buffers reused across steps, keyed by (shape, strides, dtype)."""

    def __init__(self, stats: OffloadStats) -> None:
        self.free: dict[tuple, list[_Slot]] = defaultdict(list)
        self.stats = stats

    def take(self, like: torch.Tensor, pin: bool) -> _Slot:
        key = (tuple(like.shape), like.stride(), like.dtype, pin)
        if self.free[key]:
            slot = self.free[key].pop()
            if slot.event is not None:
                slot.event.synchronize()  # a copy may still read or write it; almost never waits
            self.stats.buffers_reused += 1
            return slot
        self.stats.buffers_allocated += 1
        # Same strides as the source, so the copy back restores the exact layout.
        buffer = torch.empty_strided(
            like.shape, like.stride(), dtype=like.dtype, device="cpu", pin_memory=pin
        )
        return _Slot(buffer)

    def give(self, slot: _Slot) -> None:
        buffer = slot.buffer
        key = (tuple(buffer.shape), buffer.stride(), buffer.dtype, buffer.is_pinned())
        self.free[key].append(slot)


class _Forward:
    """The checkpointed block calls of one forward pass, in forward order."""

    def __init__(self) -> None:
        self.groups: list[_Group] = []
        self.blocks: set[int] = set()


class _Group:
    """The inputs one block call saved."""

    def __init__(self, forward: _Forward) -> None:
        self.forward = forward
        self.index = len(forward.groups)
        self.saved: list[weakref.ref[_Saved]] = []


class _Saved:
    """What autograd holds instead of an offloaded tensor."""

    def __init__(self, slot: _Slot, device: torch.device, group: _Group) -> None:
        self.slot = slot
        self.device = device
        self.group = group
        self.back: torch.Tensor | None = None  # the copy back, once started
        self.back_event: torch.cuda.Event | None = None


def _offloadable(t: torch.Tensor, min_bytes: int) -> bool:
    # Parameters stay resident anyway; subclasses (DTensor, fp8) have their own storage rules;
    # only dense layouts can be copied into an ``empty_strided`` twin.
    if isinstance(t, nn.Parameter) or type(t) is not torch.Tensor:
        return False
    if t.device.type not in ("cuda", "cpu") or t.untyped_storage().nbytes() == 0:
        return False
    dense = t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)
    return dense and t.numel() * t.element_size() >= min_bytes


class ActivationOffloader:
    """Moves checkpointed blocks' saved inputs to CPU and back, overlapped with compute.

    Example:
        >>> offloader = ActivationOffloader()
        >>> checkpoint_modules(dit, repeated_blocks(dit), offloader=offloader)
        >>> dit(x, t).sum().backward()
        >>> offloader.stats.tensors_offloaded
        56
    """

    def __init__(self, min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._pool = _BufferPool(self.stats)
        self._forward: _Forward | None = None
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    @contextmanager
    def block(self, key: object) -> Iterator[None]:
        """Offload what is saved inside this context, as the inputs of block ``key``."""
        forward = self._forward
        if forward is None or id(key) in forward.blocks:
            forward = self._forward = _Forward()  # the same block again: a new forward began
        forward.blocks.add(id(key))
        group = _Group(forward)
        forward.groups.append(group)
        with saved_tensors_hooks(lambda t: self._pack(t, group), self._unpack):
            yield

    # -- forward: copy out ---------------------------------------------------------------------
    def _pack(self, t: torch.Tensor, group: _Group) -> Any:
        if not _offloadable(t, self.min_bytes):
            self.stats.tensors_kept += 1
            return t
        slot = self._pool.take(t, pin=t.is_cuda)
        if t.is_cuda:
            d2h, _ = self._side_streams(t.device)
            d2h.wait_stream(torch.cuda.current_stream(t.device))  # t is written on compute
            with torch.cuda.stream(d2h):
                slot.buffer.copy_(t, non_blocking=True)
                slot.event = d2h.record_event()
            t.record_stream(d2h)  # t's memory is not reused before the copy has read it
        else:
            slot.buffer.copy_(t)
        saved = _Saved(slot, t.device, group)
        weakref.finalize(saved, self._pool.give, slot)  # autograd dropped it: buffer is free
        group.saved.append(weakref.ref(saved))
        self.stats.tensors_offloaded += 1
        self.stats.bytes_offloaded += t.numel() * t.element_size()
        return saved

    # -- backward: copy back ---------------------------------------------------------------------
    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        if saved.back is None:
            self._fetch(saved.group, prefetch=False)
        group = saved.group
        if group.index > 0:  # start the next block in backward order while this one computes
            self._fetch(group.forward.groups[group.index - 1], prefetch=True)
        out, saved.back = saved.back, None  # unpacked once per backward; drop our reference
        if out.is_cuda:
            compute = torch.cuda.current_stream(out.device)
            compute.wait_event(saved.back_event)
            out.record_stream(compute)  # allocated on the copy stream, used on compute
        return out

    def _fetch(self, group: _Group, prefetch: bool) -> None:
        for ref in group.saved:
            saved = ref()
            if saved is None or saved.back is not None:
                continue  # freed with its graph, or already on its way back
            source = saved.slot.buffer
            if saved.device.type == "cuda":
                _, h2d = self._side_streams(saved.device)
                with torch.cuda.stream(h2d):
                    h2d.wait_event(saved.slot.event)  # the copy out has finished
                    back = torch.empty_strided(
                        source.shape, source.stride(), dtype=source.dtype, device=saved.device
                    )
                    back.copy_(source, non_blocking=True)
                    saved.back_event = saved.slot.event = h2d.record_event()
            else:
                back = source.clone(memory_format=torch.preserve_format)
            saved.back = back
            self.stats.bytes_reloaded += source.numel() * source.element_size()
            if prefetch:
                self.stats.tensors_prefetched += 1
            else:
                self.stats.tensors_fetched_on_demand += 1

    def _side_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]
