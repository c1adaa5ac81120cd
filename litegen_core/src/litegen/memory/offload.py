"""Activation offload: what candidate blocks save for backward waits in host memory.

:class:`ActivationOffloader` installs ``saved_tensors_hooks`` around each offloaded block call
(:class:`litegen.memory.block_forward.BlockForward`, outside any compiled region), so it sees
what the block keeps for backward: a checkpointed block's inputs, everything another block
saves (for a compiled block, the saved tensors of its compiled autograd function).

Kept on the device: parameters and views of parameters (resident anyway; under FSDP their
storage is freed and regathered), tensor subclasses (DTensor, fp8), tensors below ``min_bytes``,
expanded views (they would move more bytes than they hold), and tensors whose host copy would
take the offloader past ``max_pinned_bytes``. A tensor saved
again in the same forward (an input every block receives, like text embeddings) is copied once.

On CUDA nothing waits on the host; the compute stream waits only on events:

* forward: each saved tensor is copied into pinned host memory on a side stream that first
  waits on the compute stream. The device tensor stays referenced until its copy is done: when a
  block starts, the compute stream waits on the copies of the block ``blocks_in_flight`` calls
  back and drops those references, so at most ``blocks_in_flight`` blocks wait for copies;
* backward: the first unpack of a block's tensors starts bringing back the ``blocks_in_flight``
  blocks before it (the next ones in backward order) on a second side stream. The destination is
  allocated on the compute stream (its memory comes from and returns to compute's pool), the
  copy waits on an event recorded there, and compute waits on the copy's event when it unpacks.
  Tensors still on the device (copies in flight when forward ended) are used as they are.

Pinned buffers come from torch's caching host allocator, which reuses them across steps once
their copies are done and rounds sizes up to powers of two; ``max_pinned_bytes`` (default: half
the host's memory, shared by the node's local ranks) bounds what the offloader holds at once,
counted at that rounding.

Blocks are grouped per forward pass (a forward ends when a block is called again), so gradient
accumulation and several forwards before one backward each get their own prefetch chain. On CPU
the same code runs with synchronous copies and the same bookkeeping (device tensors held while
"in flight"), which is what the unit tests exercise. Hooks may run on autograd's worker threads;
forward and backward of one model never run at once, so the bookkeeping needs no lock.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

log = logging.getLogger("litegen")

# A block's copies start when its forward ends, so with 3 they have the next two blocks' compute
# to finish in; with 2, offloaded blocks alternating with checkpointed ones (whose copies are
# small) made compute wait for every offloaded block's copies.
BLOCKS_IN_FLIGHT = 3


@dataclass
class OffloadStats:
    """What the offloader did since it was created (or since :meth:`reset`)."""

    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    tensors_kept: int = 0  # left on the device: parameters, subclasses, small tensors
    bytes_kept: int = 0
    tensors_shared: int = 0  # saved again in the same forward: one copy serves both
    tensors_over_limit: int = 0  # kept because max_pinned_bytes was reached
    tensors_prefetched: int = 0  # copied back ahead of need, while a later block computes
    tensors_fetched_on_demand: int = 0  # copied back when needed
    tensors_reused_on_device: int = 0  # still on the device when backward needed them
    bytes_reloaded: int = 0

    def reset(self) -> None:
        for name in asdict(self):
            setattr(self, name, 0)


class _Forward:
    """The offloaded block calls of one forward pass, in call order."""

    def __init__(self) -> None:
        self.groups: list[_Group] = []
        self.blocks: set[int] = set()
        self.copies: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(tensor) -> its copy


class _Group:
    """What one block call saved."""

    def __init__(self, forward: _Forward) -> None:
        self.forward = forward
        self.index = len(forward.groups)
        self.saved: list[weakref.ref[_Saved]] = []
        self.copied: torch.cuda.Event | None = None  # after the last copy to the host
        self.device: torch.device | None = None
        self.unpacked = False  # backward has reached this block


class _Saved:
    """What autograd holds instead of an offloaded tensor."""

    __slots__ = (
        "__weakref__",
        "back",
        "back_event",
        "group",
        "host",
        "in_flight",
        "shared",
        "uses",
    )

    def __init__(self, host: torch.Tensor, group: _Group) -> None:
        self.host = host
        self.group = group  # the block call that saved it first
        self.in_flight: torch.Tensor | None = None  # the device tensor while its copy may run
        self.back: torch.Tensor | None = None  # the copy back, once started
        self.back_event: torch.cuda.Event | None = None
        self.uses = 1  # saved variables holding this copy, each unpacks it once per backward
        self.shared = False  # saved by more than one block call


def _host_bytes(nbytes: int, pinned: bool) -> int:
    """What the host allocator takes for ``nbytes``: the next power of two when pinned."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 1 else nbytes


def _dense_strides(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory without gaps or overlap (a permutation of contiguous)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _default_pinned_limit() -> int:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return physical // 2 // max(local_ranks, 1)


class ActivationOffloader:
    """Moves what offloaded blocks save to host memory and back, overlapped with compute.

    Example::

        offloader = ActivationOffloader()
        checkpoint_modules(dit, repeated_blocks(dit), offloader=offloader)
        dit(x, t).sum().backward()
        offloader.stats.tensors_offloaded
    """

    def __init__(
        self,
        min_bytes: int = 1024,
        blocks_in_flight: int = BLOCKS_IN_FLIGHT,
        max_pinned_bytes: int | None = None,
    ) -> None:
        if blocks_in_flight < 1:
            raise ValueError(f"blocks_in_flight={blocks_in_flight} must be at least 1.")
        self.min_bytes = min_bytes
        self.blocks_in_flight = blocks_in_flight
        self.max_pinned_bytes = (
            _default_pinned_limit() if max_pinned_bytes is None else max_pinned_bytes
        )
        self.host_bytes = 0  # held in host copies now
        self.stats = OffloadStats()
        self._forward: _Forward | None = None
        self._in_flight: deque[_Group] = deque()
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._warned_limit = False

    @contextmanager
    def block(self, key: object) -> Iterator[None]:
        """Offload what is saved inside this context, as one call of block ``key``."""
        forward = self._forward
        if forward is None or id(key) in forward.blocks:
            forward = self._forward = _Forward()  # the same block again: a new forward began
        forward.blocks.add(id(key))
        group = _Group(forward)
        forward.groups.append(group)
        while len(self._in_flight) >= self.blocks_in_flight:
            self._retire(self._in_flight.popleft())
        self._in_flight.append(group)
        with saved_tensors_hooks(lambda t: self._pack(t, group), self._unpack):
            yield

    # -- forward: copy out ---------------------------------------------------------------------
    def _keep(self, t: torch.Tensor) -> bool:
        # type() excludes nn.Parameter and subclasses (DTensor, fp8) whose storage has its own
        # rules; views of parameters (a Linear saves weight.t()) stay too.
        if type(t) is not torch.Tensor or isinstance(t._base, nn.Parameter):
            return True
        storage = t.untyped_storage().nbytes()
        if t.device.type not in ("cuda", "cpu") or storage == 0:
            return True
        nbytes = t.numel() * t.element_size()
        # Views with gaps or overlap stay: a copy has other strides than the tensor saved, and
        # compiled backward graphs check the strides of what they saved.
        return nbytes < self.min_bytes or not _dense_strides(t)

    def _pack(self, t: torch.Tensor, group: _Group) -> Any:
        if t.numel() == 0:  # holds no memory; some torch versions' checkpoint saves such markers
            return t
        nbytes = t.numel() * t.element_size()
        if self._keep(t):
            self.stats.tensors_kept += 1
            self.stats.bytes_kept += nbytes
            return t
        known = group.forward.copies.get(id(t))
        saved = known[1]() if known is not None and known[0]() is t else None
        if saved is not None:
            saved.uses += 1
            saved.shared = True
            group.saved.append(weakref.ref(saved))  # prefetched with this block too
            group.device = group.device or saved.group.device
            self.stats.tensors_shared += 1
            return saved
        host_bytes = _host_bytes(nbytes, t.is_cuda)
        if self.host_bytes + host_bytes > self.max_pinned_bytes:
            self._over_limit()
            self.stats.tensors_kept += 1
            self.stats.bytes_kept += nbytes
            return t
        host_options = {"dtype": t.dtype, "device": "cpu", "pin_memory": t.is_cuda}
        host = torch.empty_strided(t.shape, t.stride(), **host_options)  # the same layout
        saved = _Saved(host, group)
        if t.is_cuda:
            d2h, _ = self._side_streams(t.device)
            d2h.wait_stream(torch.cuda.current_stream(t.device))  # t is written on compute
            with torch.cuda.stream(d2h):
                host.copy_(t, non_blocking=True)
            group.copied = d2h.record_event()
            group.device = t.device
        else:
            host.copy_(t)
        saved.in_flight = t  # its memory is not reused before the copy has read it
        self.host_bytes += host_bytes
        weakref.finalize(saved, self._released, host_bytes)
        group.saved.append(weakref.ref(saved))
        group.forward.copies[id(t)] = (weakref.ref(t), weakref.ref(saved))
        self.stats.tensors_offloaded += 1
        self.stats.bytes_offloaded += nbytes
        return saved

    def _retire(self, group: _Group) -> None:
        """The compute stream waits for ``group``'s copies; its device tensors may then go."""
        if group.copied is not None:
            torch.cuda.current_stream(group.device).wait_event(group.copied)
            group.copied = None
        for ref in group.saved:
            saved = ref()
            if saved is not None:
                saved.in_flight = None

    def _released(self, host_bytes: int) -> None:
        self.host_bytes -= host_bytes

    def _over_limit(self) -> None:
        self.stats.tensors_over_limit += 1
        if not self._warned_limit:
            self._warned_limit = True
            log.warning(
                "activation offload: host copies reached max_pinned_bytes (%.1f GiB); further "
                "saved tensors stay on the device.",
                self.max_pinned_bytes / 2**30,
            )

    # -- backward: copy back ---------------------------------------------------------------------
    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        group = saved.group
        if not group.unpacked and not saved.shared:  # backward reached this block
            group.unpacked = True
            groups = group.forward.groups
            for index in range(group.index - 1, group.index - 1 - self.blocks_in_flight, -1):
                if index >= 0:  # the next blocks in backward order come back meanwhile
                    self._fetch(groups[index].saved, groups[index].device, prefetch=True)
        if saved.in_flight is not None:
            out = saved.in_flight
            if group.copied is not None:  # the copy still reads it; its memory must stay put
                torch.cuda.current_stream(out.device).wait_event(group.copied)
            if saved.uses == 1:  # counted once per tensor, however many blocks share it
                self.stats.tensors_reused_on_device += 1
        else:
            if saved.back is None:
                self._fetch([weakref.ref(saved)], group.device, prefetch=False)
            out = saved.back
            if saved.back_event is not None:
                torch.cuda.current_stream(out.device).wait_event(saved.back_event)
        saved.uses -= 1
        if saved.uses <= 0:  # every saved variable has it: drop our references
            saved.in_flight = saved.back = None
        return out

    def _fetch(
        self, refs: list[weakref.ref[_Saved]], device: torch.device | None, prefetch: bool
    ) -> None:
        """Start copying back what ``refs`` hold (on ``device``; ``None``: the CPU)."""
        todo = []
        for ref in refs:
            saved = ref()
            if saved is not None and saved.back is None and saved.in_flight is None:
                todo.append(saved)
        if not todo:
            return
        if device is not None:
            compute = torch.cuda.current_stream(device)
            backs = [
                torch.empty_strided(
                    s.host.shape, s.host.stride(), dtype=s.host.dtype, device=device
                )
                for s in todo
            ]
            _, h2d = self._side_streams(device)
            h2d.wait_event(compute.record_event())  # the memory is free on compute from here
            with torch.cuda.stream(h2d):
                for saved, back in zip(todo, backs, strict=True):
                    back.copy_(saved.host, non_blocking=True)
                    back.record_stream(h2d)  # freed unused (no backward), it waits for the copy
            done = h2d.record_event()
            for saved, back in zip(todo, backs, strict=True):
                saved.back, saved.back_event = back, done
        else:
            for saved in todo:
                saved.back = saved.host.clone(memory_format=torch.preserve_format)
        for saved in todo:
            self.stats.bytes_reloaded += saved.host.numel() * saved.host.element_size()
        if prefetch:
            self.stats.tensors_prefetched += len(todo)
        else:
            self.stats.tensors_fetched_on_demand += len(todo)

    def _side_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]
