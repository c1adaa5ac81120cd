"""Flat gradient buckets for the ZeRO strategies: reduction, partitions, parameter gathers.

Parameters are packed, in reverse registration order (roughly the order backward produces
their gradients), into buckets of about ``bucket_size_mb``. A bucket never mixes optimizer
param groups or dtypes, and its length is padded to a multiple of the data-parallel size so
rank ``r`` owns the contiguous slice ``[r * n / dp, (r + 1) * n / dp)`` of every bucket: the
*partition* the optimizer steps. Collectives always run bucket by bucket in index order, so
ranks issue them in the same order even when backward makes buckets ready in another order.

Example::

    buckets = build_buckets([params], bucket_bytes=64 << 20, dp_size=2, dp_rank=0)
    grads = BucketedGradients(buckets, mode="reduce_scatter", overlap=True, release=True)
    loss.backward(); grads.finish()  # every bucket's ``shard.grad`` now holds its partition
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

# torch 2.13 names them *_single; older releases only have the *_tensor spelling.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)
class Bucket:
    """Consecutive parameters of one param group and dtype, flattened into one padded range."""

    index: int
    group: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # padded to a multiple of dp_size
    dp_size: int
    dp_rank: int
    # This rank's partition of the bucket's parameters; the optimizer steps it (None when
    # ZeroRedundancyOptimizer owns whole parameters instead).
    shard: torch.Tensor | None = None
    flat_params: torch.Tensor | None = None  # set when parameters are views into one buffer
    # Per-iteration reduction state.
    waiting: int = 0
    inflight: list[tuple] = field(default_factory=list)
    reduced: torch.Tensor | None = None
    spare: torch.Tensor | None = None  # kept between steps when release_grad_buffer is off

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp_size

    @property
    def shard_start(self) -> int:
        return self.dp_rank * self.shard_numel

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def pieces(self, start: int, numel: int):
        """(param, offset in param, offset in [start, start + numel), length) per overlap."""
        end = start + numel
        for p, offset in zip(self.params, self.offsets, strict=True):
            lo, hi = max(offset, start), min(offset + p.numel(), end)
            if lo < hi:
                yield p, lo - offset, lo - start, hi - lo

    def read_params(
        self,
        out: torch.Tensor,
        start: int,
        numel: int,
        source: Callable[[nn.Parameter], torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Copy bucket range ``[start, start + numel)`` of the parameters into ``out``.

        ``source(p)``, when given, supplies a tensor shaped like ``p`` (optimizer state, a
        loaded average) to read instead of ``p``; None leaves ``p``'s range of ``out`` as is.
        """
        for p, p_off, o_off, n in self.pieces(start, numel):
            value = p.detach() if source is None else source(p)
            if value is not None:
                out[o_off : o_off + n].copy_(value.reshape(-1)[p_off : p_off + n])
        return out


def build_buckets(
    groups: list[list[nn.Parameter]],
    *,
    bucket_bytes: int,
    dp_size: int,
    dp_rank: int,
    shard: bool = True,
    flatten: bool = False,
) -> list[Bucket]:
    """Pack each param group's trainable parameters into buckets of about ``bucket_bytes``.

    ``shard`` gives every bucket this rank's partition tensor; ``flatten``
    (``normalize_parameter_layout``) first moves the parameters into one contiguous buffer per
    bucket, so the partition is a view of the parameters and gathers write into them directly.
    """
    buckets: list[Bucket] = []
    for group_index, params in enumerate(groups):
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            if current and (
                size + p.numel() * p.element_size() > bucket_bytes or current[0].dtype != p.dtype
            ):
                buckets.append(_make_bucket(len(buckets), group_index, current, dp_size, dp_rank))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(_make_bucket(len(buckets), group_index, current, dp_size, dp_rank))
    for bucket in buckets:
        if flatten:
            _flatten_params(bucket)
        if shard:
            if bucket.flat_params is not None:
                bucket.shard = bucket.flat_params[bucket.shard_start :][: bucket.shard_numel]
            else:
                empty = torch.zeros(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)
                bucket.shard = bucket.read_params(empty, bucket.shard_start, bucket.shard_numel)
            bucket.shard.requires_grad_(True)  # a leaf the optimizer treats as a parameter
    return buckets


def _make_bucket(index, group, params, dp_size, dp_rank) -> Bucket:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    padded = -(-total // dp_size) * dp_size
    return Bucket(index, group, params, offsets, padded, dp_size, dp_rank)


def _flatten_params(bucket: Bucket) -> None:
    flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
    bucket.read_params(flat, 0, bucket.numel)
    for p, offset in zip(bucket.params, bucket.offsets, strict=True):
        # Rebinding .data keeps the Parameter object, so optimizers and hooks still see it.
        p.data = flat[offset : offset + p.numel()].view_as(p)
    bucket.flat_params = flat


class BucketedGradients:
    """Averages gradients over the data-parallel group, bucket by bucket.

    ``mode="all_reduce"`` (ZeRO-1) leaves every rank the whole averaged gradient, as views of
    the bucket buffer in ``p.grad``; ``mode="reduce_scatter"`` (ZeRO-2) keeps only this rank's
    partition and drops ``p.grad`` as soon as it is copied into the bucket. With ``overlap``,
    post-accumulate-grad hooks launch a bucket's collective as soon as its last gradient is
    ready, while backward continues; ``sync = False`` (``no_sync``) turns them off.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        *,
        mode: Literal["all_reduce", "reduce_scatter"],
        overlap: bool,
        release: bool,
    ) -> None:
        self.buckets = buckets
        self.mode = mode
        self.release = release
        self.sync = True
        self._next = 0  # the next bucket to launch, in index order
        self._callback_queued = False
        if overlap:
            for bucket in buckets:
                bucket.waiting = len(bucket.params)
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(self._hook_for(bucket))

    def _hook_for(self, bucket: Bucket):
        def hook(_param: torch.Tensor) -> None:
            if not self.sync:
                return
            if not self._callback_queued:
                # At the end of this backward, launch buckets that some parameter of which got
                # no gradient (unused in this forward), so nothing waits forever.
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._callback_queued = True
            bucket.waiting -= 1
            while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
                self._launch(self.buckets[self._next])
                self._next += 1

        return hook

    def _end_of_backward(self) -> None:
        self.launch_remaining()
        self._callback_queued = False

    def launch_remaining(self) -> None:
        for bucket in self.buckets[self._next :]:
            self._launch(bucket)
        self._next = 0
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)

    def _launch(self, bucket: Bucket) -> None:
        buffer = bucket.spare if bucket.spare is not None and not bucket.inflight else None
        bucket.spare = None
        if buffer is None:
            buffer = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            view = buffer[offset : offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            # Later micro-batches accumulate from zero; their reductions are added below.
            p.grad = None
        # Divide before summing, as DDP does, so results match it bit for bit where possible.
        buffer.div_(bucket.dp_size)
        if self.mode == "all_reduce":
            work = dist.all_reduce(buffer, async_op=True)
            bucket.inflight.append((work, buffer, buffer))
        else:
            out = torch.empty(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)
            work = _reduce_scatter(out, buffer, async_op=True)
            bucket.inflight.append((work, out, buffer))

    def finish(self) -> None:
        """Wait for every reduction and expose the averaged gradients; idempotent per step."""
        if not any(b.inflight or b.reduced is not None for b in self.buckets):
            self.launch_remaining()  # overlap off, or no backward ran with sync on
        for bucket in self.buckets:
            for work, out, _ in bucket.inflight:
                work.wait()
                bucket.reduced = out if bucket.reduced is None else bucket.reduced.add_(out)
            bucket.inflight = []
            reduced = bucket.reduced
            if self.mode == "all_reduce":
                for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                    p.grad = reduced[offset : offset + p.numel()].view_as(p)
                if bucket.shard is not None:
                    bucket.shard.grad = reduced[bucket.shard_start :][: bucket.shard_numel]
            else:
                bucket.shard.grad = reduced

    def clear(self) -> None:
        """Drop this step's gradients (after the optimizer step)."""
        for bucket in self.buckets:
            if not self.release and bucket.reduced is not None and self.mode == "all_reduce":
                bucket.spare = bucket.reduced  # reuse the buffer for the next step
            bucket.reduced = None
            for p in bucket.params:
                p.grad = None
            if bucket.shard is not None:
                bucket.shard.grad = None

    def discard(self) -> None:
        """Forget gradients and reductions of a step that will not happen (zero_grad)."""
        for bucket in self.buckets:
            for work, _, _ in bucket.inflight:
                work.wait()  # a collective cannot be cancelled; every rank finishes it
            bucket.inflight = []
        self.clear()
        self._next = 0
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)

    def shard_grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient partition (padding is zero)."""
        total = torch.zeros((), dtype=torch.float32, device=self.buckets[0].device)
        for bucket in self.buckets:
            grad = bucket.shard.grad
            if grad is not None:
                total += grad.float().pow(2).sum()
        return total


def gather_params(buckets: list[Bucket]) -> None:
    """All-gather every bucket's updated partition back into the replicated parameters."""
    pending = []
    for bucket in buckets:
        out = bucket.flat_params
        if out is None:
            out = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        # The input may be a view of the output (flat layout); a copy keeps backends happy.
        source = (
            bucket.shard.detach().clone()
            if bucket.flat_params is not None
            else bucket.shard.detach()
        )
        pending.append((bucket, out, source, _all_gather(out, source, async_op=True)))
    for bucket, out, _source, work in pending:
        work.wait()
        if bucket.flat_params is None:
            with torch.no_grad():
                for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                    p.copy_(out[offset : offset + p.numel()].view_as(p))


def refresh_shards(buckets: list[Bucket]) -> None:
    """Copy the parameters into the partitions (they may have been loaded or edited)."""
    with torch.no_grad():
        for bucket in buckets:
            if bucket.shard is not None and bucket.flat_params is None:
                bucket.read_params(bucket.shard, bucket.shard_start, bucket.shard_numel)
