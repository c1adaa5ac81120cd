"""The collectives of Ulysses sequence parallelism, each with its adjoint as backward.

Every rank of a sequence-parallel group holds one contiguous shard of each sample's sequence.
Gradients follow one rule: each rank's backward computes its own contribution, so that summed
over the group they give the gradient of the sum of the group's (identical) losses. Every
collective therefore has its exact adjoint as backward (all-to-all: the reverse all-to-all;
all-gather: reduce-scatter with sum; taking a slice of a replicated tensor: the zero-padded
slice), and the data-parallel strategies average gradients over every rank, which turns the
sum over the group into the single-process gradient (see ``docs/sequence_parallel.md``).

The collectives are ``torch.distributed._functional_collectives`` ops, which ``torch.compile``
traces into the graph of a compiled block.

Example::

    heads = seq_to_heads(q, group)  # (B, H, S/N, D) -> (B, H/N, S, D)
    out = heads_to_seq(attention(heads, ...), group)  # and back
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

# torch 2.13 names them *_single; older releases only have the *_tensor spelling.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i``; the result's chunk ``j`` came from rank ``j``."""
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))


def _scatter_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, H, S, D) -> (n, B, H/n, S, D): the head groups to send, destination first."""
    b, h, s, d = x.shape
    return x.reshape(b, n, h // n, s, d).transpose(0, 1)


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    received = _all_to_all(_scatter_heads(x, n), group)  # (n source ranks, B, H/n, S/n, D)
    _, b, h, s, d = received.shape
    return received.permute(1, 2, 0, 3, 4).reshape(b, h, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4)  # (n dest ranks, B, H/n, ..)
    received = _all_to_all(chunks, group)  # (n source head groups, B, H/n, S/n, D)
    return received.transpose(0, 1).reshape(b, n * h, s // n, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, H, S/N, D)`` sequence shards -> ``(B, H/N, S, D)``: all tokens, this rank's heads.

    Rank ``r`` receives head group ``r`` (heads ``[r H/N, (r + 1) H/N)``); the sequence is the
    shards in rank order. Backward is :func:`heads_to_seq`.

    Example::

        seq_to_heads(torch.zeros(1, 8, 5, 64), group).shape  # 2 ranks
    """
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, H/N, S, D)`` -> ``(B, H, S/N, D)``, the inverse of :func:`seq_to_heads`.

    Example::

        heads_to_seq(torch.zeros(1, 4, 10, 64), group).shape  # 2 ranks
    """
    return _HeadsToSeq.apply(x, group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return funcol.wait_tensor(_all_gather(x.contiguous(), dim, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        reduced = _reduce_scatter(grad.contiguous(), "sum", ctx.dim, ctx.group)
        return funcol.wait_tensor(reduced), None, None


def gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` over ``group`` (rank order); backward: reduce-scatter sum.

    Example::

        gather(torch.zeros(1, 5, 16), 1, group).shape  # 2 ranks
    """
    return _Gather.apply(x, dim, group)


def padded_length(length: int, n: int) -> int:
    """``length`` rounded up to a multiple of ``n``: ``padded_length(10, 4)`` -> ``12``."""
    return -(-length // n) * n


def shard(x: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous ``1/n`` of ``x`` along ``dim``, zero-padded at the end first.

    The shard is copied so that the whole tensor can be freed; its backward puts the gradient
    into the rank's slice of zeros (the adjoint of taking a slice of a replicated tensor).

    Example:
        >>> shard(torch.arange(10.0).view(1, 10), 1, rank=3, n=4)
        tensor([[9., 0., 0.]])
    """
    dim = dim % x.dim()
    length = x.shape[dim]
    padded = padded_length(length, n)
    if padded != length:
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, padded - length]
        x = F.pad(x, pad)
    local = padded // n
    return x.narrow(dim, rank * local, local).clone(memory_format=torch.contiguous_format)


__all__ = ["gather", "heads_to_seq", "padded_length", "seq_to_heads", "shard"]
