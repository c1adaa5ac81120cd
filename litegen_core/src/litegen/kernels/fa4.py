"""FlashAttention 4 as the kernels behind torch's flash SDPA backend (``attention_backend: flash_attn``).

FA4 is the ``flash-attn-4`` package (the ``flash-attn-4`` extra): CuTe DSL kernels for Hopper and
Blackwell, compiled just in time on first use for each shape family. :func:`register` makes them
the CUDA implementation of ``aten::_scaled_dot_product_flash_attention`` and of its backward, the
two ops torch's flash backend calls. So models keep calling ``F.scaled_dot_product_attention``,
``sdpa_kernel`` selects FA4 like any backend, and autograd and ``torch.compile`` see the same aten
ops as before, with their meta kernels. torch 2.11 has a prototype of the same idea
(``torch.nn.attention.activate_flash_attention_impl("FA4")``); it expects FA4's forward to return
two values and fails on current FA4 releases, which return five.

Outputs are allocated the way the ops' meta kernels allocate them (``torch.empty_like`` of the
input): compiled graphs assert those strides. For a model that splits a fused qkv projection,
that is FA4's own layout, (batch, tokens, heads, dim) in memory, so FA4 writes the output in
place and the model's reshape after attention copies nothing.

Example:
    >>> if register():  # False without the package
    ...     with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    ...         out = F.scaled_dot_product_attention(q, k, v)  # FA4's kernels
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
import triton
import triton.language as tl

FA4_MODULE = "flash_attn.cute.interface"
HEAD_DIM_MULTIPLE = 32  # head dims FA4's Hopper backward gets right (see _pad_head_dim)
_library: torch.library.Library | None = None  # kept alive: dropping it unregisters the kernels


def register() -> bool:
    """Route torch's flash SDPA ops on CUDA to FA4; True once they are, False without FA4."""
    global _library
    if _library is None:
        try:
            interface()
        except ImportError:
            return False
        library = torch.library.Library("aten", "IMPL")
        library.impl("_scaled_dot_product_flash_attention", forward, "CUDA")
        library.impl("_scaled_dot_product_flash_attention_backward", backward, "CUDA")
        _library = library
    return True


@functools.cache
def interface() -> ModuleType:
    """FA4's interface module (ImportError when the package or its kernels are missing)."""
    module = importlib.import_module(FA4_MODULE)
    if not hasattr(module, "_flash_attn_fwd") or not hasattr(module, "_flash_attn_bwd"):
        raise ImportError(
            f"{FA4_MODULE} has no _flash_attn_fwd/_flash_attn_bwd; update flash-attn-4"
        )
    return module


def forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple:
    """``aten::_scaled_dot_product_flash_attention`` on FA4; inputs are (batch, heads, tokens, dim)."""
    if dropout_p != 0.0 or return_debug_mask:
        raise RuntimeError(
            "FA4 attention has no dropout or debug mask; set attention dropout to 0 or use "
            "optimization.kernels.attention_backend=auto"
        )
    out = torch.empty_like(query)
    _, lse, *_ = interface()._flash_attn_fwd(
        *_bshd(query, key, value),
        softmax_scale=scale,
        causal=is_causal,
        return_lse=True,
        out=out.transpose(1, 2),
    )
    device = query.device
    return (
        out,
        lse.contiguous(),
        None,
        None,
        query.size(2),
        key.size(2),
        torch.zeros(2, dtype=torch.uint64, device=device),  # no dropout, so no RNG state
        torch.zeros((), dtype=torch.uint64, device=device),
        torch.empty(0, dtype=query.dtype, device=device),
    )


def backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten::_scaled_dot_product_flash_attention_backward`` on FA4."""
    grads = tuple(torch.empty_like(t) for t in (query, key, value))
    scale = query.size(-1) ** -0.5 if scale is None else scale
    # Padded in FA4's layout, so that the padded copies are contiguous in it.
    padded = _pad_head_dim(*_bshd(query, key, value, out, grad_out))
    unpadded = padded[0].size(-1) == query.size(-1)
    # Unpadded, FA4 writes the gradients straight into their meta-kernel layout.
    dq, dk, dv = _bshd(*grads) if unpadded else (None, None, None)
    written = interface()._flash_attn_bwd(
        *padded,
        logsumexp.contiguous(),
        softmax_scale=scale,
        causal=is_causal,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        dq=dq,
        dk=dk,
        dv=dv,
    )
    for grad, result in zip(grads, written[:3], strict=True):
        if result.data_ptr() != grad.data_ptr():
            copy_head_dim(result, grad.transpose(1, 2))
    return grads


def _bshd(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(batch, heads, tokens, dim) views as FA4's (batch, tokens, heads, dim)."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _pad_head_dim(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors zero-padded to a head dim that is a multiple of 32 (unchanged if it is one).

    FA4's Hopper backward computes dq wrong when the head dim is not a multiple of 32 (measured
    on H200 with flash-attn-4 4.0.0b36: dq off by up to 1.6 at 72 and 80, right at 96 and 128;
    the output, dk and dv right at all four), and it needs one head dim for q, k and v. Zero
    columns change neither q @ k^T nor the rows of dO @ O^T, so only the backward pads, with the
    unpadded softmax scale, and the gradients are sliced back.
    """
    head_dim = tensors[0].size(-1)
    padded = -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE
    if padded == head_dim:
        return tensors
    return tuple(copy_head_dim(t, t.new_empty(*t.shape[:-1], padded)) for t in tensors)


def copy_head_dim(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy ``src``'s first columns into ``dst``, zero-filling what is past ``src``'s; returns dst.

    One pass for both directions of the padding above, over (batch, tokens, heads, dim) tensors
    of any strides whose last dim is contiguous. Padding A's q from 72 to 96 columns measured
    1.5-2.7x faster than ``F.pad`` on H200 (``scripts/bench_fa4.py --section copy``).

    Example:
        >>> copy_head_dim(q, q.new_empty(*q.shape[:-1], 96))  # q zero-padded to head dim 96
    """
    assert src.shape[:-1] == dst.shape[:-1] and src.stride(-1) == dst.stride(-1) == 1
    batch, tokens, heads, _ = src.shape
    rows = batch * tokens * heads
    block_dim = triton.next_power_of_2(max(src.size(-1), dst.size(-1)))
    _copy_head_dim_kernel[(triton.cdiv(rows, _ROWS_PER_PROGRAM),)](
        src,
        dst,
        rows,
        tokens,
        heads,
        *src.stride()[:3],
        *dst.stride()[:3],
        SRC_DIM=src.size(-1),
        DST_DIM=dst.size(-1),
        ROWS=_ROWS_PER_PROGRAM,
        BLOCK_DIM=block_dim,
        num_warps=_NUM_WARPS,
    )
    return dst


_ROWS_PER_PROGRAM, _NUM_WARPS = 32, 4


@triton.jit
def _copy_head_dim_kernel(
    src,
    dst,
    rows,
    tokens,
    heads,
    src_batch_stride,
    src_token_stride,
    src_head_stride,
    dst_batch_stride,
    dst_token_stride,
    dst_head_stride,
    SRC_DIM: tl.constexpr,
    DST_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    # A row is one (batch, token, head); rows run in that order, so a (batch, tokens, heads,
    # dim)-contiguous side is read or written in one sweep.
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK_DIM)
    head = row % heads
    token = (row // heads) % tokens
    batch = row // (heads * tokens)
    in_rows = (row < rows)[:, None]
    src_row = batch * src_batch_stride + token * src_token_stride + head * src_head_stride
    dst_row = batch * dst_batch_stride + token * dst_token_stride + head * dst_head_stride
    values = tl.load(
        src + src_row[:, None] + col[None, :],
        mask=in_rows & (col[None, :] < SRC_DIM),
        other=0.0,
    )
    tl.store(dst + dst_row[:, None] + col[None, :], values, mask=in_rows & (col[None, :] < DST_DIM))


__all__ = ["FA4_MODULE", "backward", "copy_head_dim", "forward", "interface", "register"]
