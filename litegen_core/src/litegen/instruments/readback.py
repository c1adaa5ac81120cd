"""Read device values on the host without making the host wait for the device.

``.item()`` on a CUDA tensor waits for every kernel queued so far; the GPU then idles while the
host queues the next step, and data loading and Python overhead are no longer hidden behind
its work. :class:`Readback` copies the values to pinned host memory behind the kernels that
compute them, records an event, and hands them back once the event has completed (checked
without waiting at each :meth:`Readback.ready`), or all of them at the end. Each value comes
with the device time of its event, so rates over steps need no host sync either.

Example:
    >>> loss, grad_norm = torch.tensor(0.5), torch.tensor(2.0)
    >>> readback = Readback(torch.device("cpu"))  # on CUDA, push returns before the copy is done
    >>> readback.push(torch.stack([loss, grad_norm]), "step 7")
    >>> for tag, values, when in readback.ready():  # the ones that have arrived
    ...     print(tag, values)
    step 7 [0.5, 2.0]
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Pending:
    tag: Any
    values: torch.Tensor | list[float]  # pinned host memory being filled, or the values
    event: torch.cuda.Event | None
    wall: float  # time.time() of the push (off CUDA: when the values were final)


class Readback:
    """A queue of device values on their way to the host (module docstring).

    ``max_pending`` bounds how far the host may run ahead of the values: beyond it,
    :meth:`ready` waits for the oldest (the device then still has that many pushes' work queued).
    ``start_time`` is the wall time of the queue's creation, the start of the first interval.
    """

    def __init__(self, device: torch.device, *, max_pending: int = 2) -> None:
        self.cuda = device.type == "cuda"
        self.max_pending = max_pending
        self._queue: deque[_Pending] = deque()
        self._origin: tuple[torch.cuda.Event, float] | None = None
        if self.cuda:
            # One sync, before the loop: device times become wall times from here on.
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            start.synchronize()
            self._origin = (start, time.time())
        self.start_time = time.time() if self._origin is None else self._origin[1]

    def push(self, values: torch.Tensor, tag: Any) -> None:
        """Queue ``values`` (any shape, read back as a flat list of floats) under ``tag``."""
        if not self.cuda:  # the values are final already (CPU), or only a blocking copy exists
            self._queue.append(_Pending(tag, values.reshape(-1).tolist(), None, time.time()))
            return
        values = values.detach().float().reshape(-1)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._queue.append(_Pending(tag, host, event, time.time()))

    def ready(self, wait: bool = False) -> Iterator[tuple[Any, list[float], float]]:
        """``(tag, values, wall time when they were computed)`` of every arrived push, in order.

        ``wait=True`` waits for all of them (at the end of a run).
        """
        while self._queue:
            pending = self._queue[0]
            if pending.event is not None:
                due = wait or len(self._queue) > self.max_pending
                if not (due or pending.event.query()):
                    return
                pending.event.synchronize()
            self._queue.popleft()
            values = pending.values if pending.event is None else pending.values.tolist()
            yield pending.tag, values, self._wall_time(pending)

    def _wall_time(self, pending: _Pending) -> float:
        if pending.event is None:
            return pending.wall
        start, wall = self._origin
        return wall + start.elapsed_time(pending.event) / 1e3


__all__ = ["Readback"]
