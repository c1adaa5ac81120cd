"""Ring attention (``optimization.parallel.cp_size``): attention of this rank's queries against
keys and values spread over a ring group, exact in forward and backward.

Each rank of the ring holds one contiguous chunk of the split tokens' keys and values. torch's
templated ring (:mod:`.torch_ring`) passes the chunks round the group and merges the partial
results by their log-sum-exp; LiteGen gives it a per-block op (:class:`_Blocks`) that

- cuts the padding off each chunk (a sequence that does not divide is padded at its end), so
  padding is never attended and no mask is needed for it;
- applies the part of a key mask that covers that chunk;
- calls a fused attention kernel that returns the log-sum-exp (:class:`Kernel`): flash
  attention on the CPU, flash (bf16/fp16, no mask) or memory-efficient attention on CUDA.

Keys every rank holds whole (the text of joint attention) are one more block, attended locally
and merged the same way, so text is never passed round the ring.

Example::

    out = ring_attention(q, k, v, RingSpec(group, lengths=(4, 3)))  # 7 tokens on 2 ranks
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from litegen.parallel.sequence import torch_ring

aten = torch.ops.aten


@dataclass(frozen=True)
class RingSpec:
    """One ring attention call: the group, the real tokens of each rank's chunk (its keys are
    padded to the longest), the key mask of each chunk and of the local keys, the scale.

    Example::

        RingSpec(group, lengths=(4, 3))  # 7 tokens over 2 ranks, the second chunk padded
    """

    group: dist.ProcessGroup
    lengths: tuple[int, ...]
    chunk_masks: tuple[torch.Tensor | None, ...] | None = None
    local_mask: torch.Tensor | None = None
    scale: float | None = None


class Kernel:
    """One block of attention that returns its log-sum-exp, and that block's backward.

    Inputs are ``(B, H, S, D)``; a mask is additive, broadcastable to ``(B, H, Sq, Sk)``.

    Example:
        >>> q = torch.randn(1, 2, 5, 8)
        >>> out, lse, _ = Kernel(q, masked=False).forward(q, q, q, None, None)
        >>> out.shape, lse.shape
        (torch.Size([1, 2, 5, 8]), torch.Size([1, 2, 5]))
    """

    def __init__(self, query: torch.Tensor, masked: bool) -> None:
        self.device = query.device.type
        self.flash = (
            self.device == "cuda"
            and not masked
            and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] <= 256
        )

    def forward(self, q, k, v, mask, scale):
        """``(out, lse, saved)``; ``saved`` is what the block's backward needs besides them."""
        if self.device == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=mask, scale=scale
            )
            return out, lse, None
        if self.flash:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
                aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            )
            return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
        bias = _aligned_bias(mask, q, k)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, False, scale=scale
        )
        # The kernel may round the log-sum-exp's length up; the merge needs it per query.
        return out, lse[..., : q.shape[2]], (bias, seed, offset, lse.shape[-1])

    def backward(self, grad_out, q, k, v, out, lse, mask, scale, saved):
        """``(grad_q, grad_k, grad_v)`` of one block, given the merged ``out`` and ``lse``."""
        if self.device == "cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
            )
        if self.flash:
            cum_q, cum_k, max_q, max_k, seed, offset = saved
            return aten._scaled_dot_product_flash_attention_backward(
                grad_out,
                q,
                k,
                v,
                out,
                lse,
                cum_q,
                cum_k,
                max_q,
                max_k,
                0.0,
                False,
                seed,
                offset,
                scale=scale,
            )
        bias, seed, offset, lse_length = saved
        lse = F.pad(lse, (0, lse_length - lse.shape[-1])).contiguous()
        grads = aten._scaled_dot_product_efficient_attention_backward(
            grad_out,
            q,
            k,
            v,
            bias,
            out,
            lse,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            False,
            scale=scale,
        )
        return grads[0], grads[1], grads[2]


def _aligned_bias(mask, q, k):
    """The memory-efficient kernel's bias: the mask expanded over ``(B, H, Sq, Sk)`` (no copy)
    from storage whose last dimension is padded to a multiple of 16, as the kernel requires."""
    if mask is None:
        return None
    keys = k.shape[2]
    padded = torch.zeros((*mask.shape[:-1], -(-keys // 16) * 16), dtype=q.dtype, device=q.device)
    padded[..., :keys] = mask
    b, h, sq, _ = q.shape
    return padded[..., :keys].expand(b, h, sq, keys)


class _Blocks:
    """The per-block op handed to torch's ring: call ``i`` gets the chunk of group rank
    ``(rank - i) % size`` (torch's rotation), cuts its padding and applies its mask."""

    def __init__(self, spec: RingSpec, kernel: Kernel) -> None:
        self.spec, self.kernel = spec, kernel
        self.rank = dist.get_rank(spec.group)
        self.size = dist.get_world_size(spec.group)
        self.calls = 0
        self.saved: dict[int, object] = {}

    def _next_source(self) -> int:
        source = (self.rank - self.calls) % self.size
        self.calls += 1
        return source

    def _mask(self, source: int) -> torch.Tensor | None:
        return None if self.spec.chunk_masks is None else self.spec.chunk_masks[source]

    def forward(self, q, k, v, is_causal=False, **_):
        source = self._next_source()
        k, v = _real(k, self.spec.lengths[source]), _real(v, self.spec.lengths[source])
        out, lse, saved = self.kernel.forward(q, k, v, self._mask(source), self.spec.scale)
        self.saved[source] = saved
        return out, lse

    def backward(self, grad_out, query, key, value, out, logsumexp, is_causal=False, **_):
        source = self._next_source()
        n, padded = self.spec.lengths[source], key.shape[2]
        grad_q, grad_k, grad_v = self.kernel.backward(
            grad_out,
            query,
            _real(key, n),
            _real(value, n),
            out,
            logsumexp,
            self._mask(source),
            self.spec.scale,
            self.saved[source],
        )
        pad = (0, 0, 0, padded - n)
        return grad_q, F.pad(grad_k, pad), F.pad(grad_v, pad)


def _real(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` (real) tokens of a padded chunk, contiguous for the kernels."""
    return x if x.shape[2] == n else x[:, :, :n].contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, local_key, local_value, spec: RingSpec):
        masked = spec.local_mask is not None or (
            spec.chunk_masks is not None and any(m is not None for m in spec.chunk_masks)
        )
        kernel = Kernel(query, masked)
        blocks = _Blocks(spec, kernel)
        out, lse = torch_ring.ring_forward(spec.group, blocks.forward, query, key, value)
        local_saved = None
        if local_key is not None:
            local_out, local_lse, local_saved = kernel.forward(
                query, local_key, local_value, spec.local_mask, spec.scale
            )
            out, lse = torch_ring.merge(out, lse, local_out, local_lse)
        ctx.save_for_backward(query, key, value, local_key, local_value, out, lse)
        ctx.spec, ctx.kernel, ctx.blocks, ctx.local_saved = spec, kernel, blocks, local_saved
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, local_key, local_value, out, lse = ctx.saved_tensors
        spec, kernel, blocks = ctx.spec, ctx.kernel, ctx.blocks
        grad_out = grad_out.contiguous()
        blocks.calls = 0
        grad_q, grad_k, grad_v = torch_ring.ring_backward(
            spec.group, blocks.backward, grad_out, query, key, value, out, lse
        )
        grad_local_k = grad_local_v = None
        if local_key is not None:
            local_q, grad_local_k, grad_local_v = kernel.backward(
                grad_out,
                query,
                local_key,
                local_value,
                out,
                lse,
                spec.local_mask,
                spec.scale,
                ctx.local_saved,
            )
            grad_q = grad_q + local_q
        return grad_q, grad_k, grad_v, grad_local_k, grad_local_v, None


@torch.compiler.disable
def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spec: RingSpec,
    local_key: torch.Tensor | None = None,
    local_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` (``(B, H, Sq, D)``) over every ring rank's ``key``/``value``
    chunk (``(B, H, C, D)``, of which rank ``r``'s first ``spec.lengths[r]`` tokens are real)
    and over ``local_key``/``local_value``, which every rank holds whole.

    Compiled blocks run it outside their graph (torch's ring is Python with collectives).

    Example::

        out = ring_attention(q, k, v, RingSpec(group, lengths=(4, 4)))
    """
    torch_ring.require()
    parts = [t.contiguous() for t in (query, key, value)]
    local = [None if t is None else t.contiguous() for t in (local_key, local_value)]
    return _RingAttention.apply(*parts, *local, spec)


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the additive one the fused kernels take.

    Example:
        >>> additive_mask(torch.tensor([True, False]), torch.float32)
        tensor([0., -inf])
    """
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


def chunk_lengths(length: int, chunk: int, size: int) -> tuple[int, ...]:
    """Real tokens of each of ``size`` chunks of ``chunk`` tokens over a sequence of ``length``.

    Example:
        >>> chunk_lengths(7, 4, 2)
        (4, 3)
    """
    return tuple(max(0, min(chunk, length - r * chunk)) for r in range(size))


def chunk_masks(
    mask: torch.Tensor | None, at: int, chunk: int, lengths: Sequence[int]
) -> tuple[torch.Tensor | None, ...] | None:
    """Each chunk's columns of a key ``mask`` whose split tokens start at column ``at``.

    Example:
        >>> [m.tolist() for m in chunk_masks(torch.arange(9.0), 2, 4, (4, 3))]
        [[2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]
    """
    if mask is None:
        return None
    return tuple(mask.narrow(-1, at + r * chunk, n) for r, n in enumerate(lengths))


__all__ = ["Kernel", "RingSpec", "additive_mask", "chunk_lengths", "chunk_masks", "ring_attention"]
