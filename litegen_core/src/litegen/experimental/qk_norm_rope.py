"""RMSNorm across heads, then interleaved rotary embedding, in one Triton pass each way.

Wan's self-attention normalises its query and key over all heads at once (RMSNorm of width
``heads * head_dim``), then rotates each head's pairs ``(x[2i], x[2i+1])`` by the token's
angles. Compiled, inductor reads a row this wide twice in each direction (its one-pass
reductions stop at 1024 elements); this op reads a row once and writes it once, forward and
backward (the weight's gradient is summed per program, then across programs). It reads the
query and the key where the QKV projection wrote them, rows one stride apart.

The arithmetic is FP32 from the input to the single rounding of the output, as under CUDA
autocast, where ``rms_norm`` runs in FP32 and the rotated query reaches attention in FP32.
Off CUDA the same formula runs with torch's ops (:func:`reference`).

Example::

    q = qk_norm_rope(q, attn.norm_q.weight, cos, sin, eps=1e-6)  # (B, L, H * D), q's dtype
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# Programs of the backward pass per SM: each sums the weight gradient of its rows in registers,
# and several share an SM to hide the latency of their loads.
_BACKWARD_PROGRAMS_PER_SM = 8


@triton.jit
def _angles(
    cos_ptr, sin_ptr, row, pair, mask, tokens, freq_batch_stride, freq_token_stride, half_head
):
    """Each pair's cos and sin for one row: cos from its head slot's even element, sin from the
    odd one, as diffusers' Wan rotates."""
    freq = (row // tokens) * freq_batch_stride + (row % tokens) * freq_token_stride
    slot = 2 * (pair % half_head)
    cos = tl.load(cos_ptr + freq + slot, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + freq + slot + 1, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _forward_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    rstd_ptr,
    x_row_stride,
    tokens,
    freq_batch_stride,
    freq_token_stride,
    half_head,
    eps,
    WIDTH: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pair = tl.arange(0, HALF_BLOCK)
    mask = pair < WIDTH // 2
    x_row = x_ptr + row * x_row_stride + 2 * pair
    x_even = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x_odd = tl.load(x_row + 1, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x_even * x_even, 0) + tl.sum(x_odd * x_odd, 0)) / WIDTH + eps)
    tl.store(rstd_ptr + row, rstd)
    y_even = x_even * rstd * tl.load(w_ptr + 2 * pair, mask=mask, other=0.0).to(tl.float32)
    y_odd = x_odd * rstd * tl.load(w_ptr + 2 * pair + 1, mask=mask, other=0.0).to(tl.float32)
    cos, sin = _angles(
        cos_ptr, sin_ptr, row, pair, mask, tokens, freq_batch_stride, freq_token_stride, half_head
    )
    out = y_ptr + row * WIDTH + 2 * pair
    tl.store(out, (y_even * cos - y_odd * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 1, (y_even * sin + y_odd * cos).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    grad_ptr,
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    rstd_ptr,
    grad_x_ptr,
    grad_w_partial_ptr,
    x_row_stride,
    rows,
    tokens,
    freq_batch_stride,
    freq_token_stride,
    half_head,
    WIDTH: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)
    pair = tl.arange(0, HALF_BLOCK)
    mask = pair < WIDTH // 2
    w_even = tl.load(w_ptr + 2 * pair, mask=mask, other=0.0).to(tl.float32)
    w_odd = tl.load(w_ptr + 2 * pair + 1, mask=mask, other=0.0).to(tl.float32)
    grad_w_even = tl.zeros([HALF_BLOCK], dtype=tl.float32)
    grad_w_odd = tl.zeros([HALF_BLOCK], dtype=tl.float32)
    for row in tl.range(program, rows, tl.num_programs(0)):
        at = row * WIDTH + 2 * pair
        g_even = tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)
        g_odd = tl.load(grad_ptr + at + 1, mask=mask, other=0.0).to(tl.float32)
        cos, sin = _angles(
            cos_ptr,
            sin_ptr,
            row,
            pair,
            mask,
            tokens,
            freq_batch_stride,
            freq_token_stride,
            half_head,
        )
        # The rotation's transpose takes the output gradient back to the normalised row's.
        dy_even = g_even * cos + g_odd * sin
        dy_odd = g_odd * cos - g_even * sin
        rstd = tl.load(rstd_ptr + row)
        x_row = x_ptr + row * x_row_stride + 2 * pair
        n_even = tl.load(x_row, mask=mask, other=0.0).to(tl.float32) * rstd
        n_odd = tl.load(x_row + 1, mask=mask, other=0.0).to(tl.float32) * rstd
        grad_w_even += dy_even * n_even
        grad_w_odd += dy_odd * n_odd
        dn_even = dy_even * w_even
        dn_odd = dy_odd * w_odd
        mean_dn_n = (tl.sum(dn_even * n_even, 0) + tl.sum(dn_odd * n_odd, 0)) / WIDTH
        out_type = grad_x_ptr.dtype.element_ty
        tl.store(grad_x_ptr + at, (rstd * (dn_even - n_even * mean_dn_n)).to(out_type), mask=mask)
        tl.store(grad_x_ptr + at + 1, (rstd * (dn_odd - n_odd * mean_dn_n)).to(out_type), mask=mask)
    partial = grad_w_partial_ptr + program * WIDTH + 2 * pair
    tl.store(partial, grad_w_even, mask=mask)
    tl.store(partial + 1, grad_w_odd, mask=mask)


def reference(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """The op with torch's kernels: ``x`` ``(B, L, H * D)``, ``cos``/``sin`` ``(B or 1, L, 1, D)``.

    Example::

        reference(q, attn.norm_q.weight, cos, sin, 1e-6).shape == q.shape
    """
    batch, tokens, width = x.shape
    head = cos.shape[-1]
    y = torch.nn.functional.rms_norm(x.float(), (width,), weight.float(), eps)
    even, odd = y.view(batch, tokens, width // head, head // 2, 2).unbind(-1)
    # A pair takes its cos from its even slot and its sin from its odd one.
    cos_pair, sin_pair = cos[..., 0::2].float(), sin[..., 1::2].float()
    rotated = torch.stack([even * cos_pair - odd * sin_pair, even * sin_pair + odd * cos_pair], -1)
    return rotated.view(batch, tokens, width).to(x.dtype)


def _freq_strides(cos: Tensor) -> tuple[int, int]:
    return (0 if cos.shape[0] == 1 else cos.stride(0)), cos.stride(1)


def _half_block(width: int) -> int:
    return triton.next_power_of_2(width // 2)


def _runs_triton(x: Tensor) -> bool:
    """CUDA, or CPU under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@torch.library.custom_op("litegen::qk_norm_rope", mutates_args=())
def _forward(
    x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    batch, tokens, width = x.shape
    if not _runs_triton(x):
        y = reference(x, weight, cos, sin, eps)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        return y, rstd.view(-1)
    y = x.new_empty(x.shape)
    rstd = x.new_empty(batch * tokens, dtype=torch.float32)
    _forward_kernel[(batch * tokens,)](
        x,
        weight,
        cos,
        sin,
        y,
        rstd,
        x.stride(1),
        tokens,
        *_freq_strides(cos),
        cos.shape[-1] // 2,
        eps,
        WIDTH=width,
        HALF_BLOCK=_half_block(width),
        num_warps=4,
    )
    return y, rstd


@_forward.register_fake
def _(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape[0] * x.shape[1], dtype=torch.float32)


@torch.library.custom_op("litegen::qk_norm_rope_backward", mutates_args=())
def _backward_op(
    grad: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    batch, tokens, width = x.shape
    if not _runs_triton(x):
        return _reference_backward(grad, x, weight, cos, sin, rstd)
    programs = min(batch * tokens, _BACKWARD_PROGRAMS_PER_SM * _sm_count(x.device))
    grad_x = x.new_empty(x.shape)
    partial = x.new_empty(programs, width, dtype=torch.float32)
    _backward_kernel[(programs,)](
        grad,
        x,
        weight,
        cos,
        sin,
        rstd,
        grad_x,
        partial,
        x.stride(1),
        batch * tokens,
        tokens,
        *_freq_strides(cos),
        cos.shape[-1] // 2,
        WIDTH=width,
        HALF_BLOCK=_half_block(width),
        num_warps=8,
    )
    return grad_x, partial.sum(0).to(weight.dtype)


@_backward_op.register_fake
def _(
    grad: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), torch.empty_like(weight)


def _reference_backward(
    grad: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """The backward kernel's formula with torch's ops."""
    batch, tokens, width = x.shape
    head = cos.shape[-1]
    g_even, g_odd = grad.float().view(batch, tokens, width // head, head // 2, 2).unbind(-1)
    cos_pair, sin_pair = cos[..., 0::2].float(), sin[..., 1::2].float()
    dy = torch.stack(
        [g_even * cos_pair + g_odd * sin_pair, g_odd * cos_pair - g_even * sin_pair], -1
    )
    dy = dy.view(batch, tokens, width)
    rstd = rstd.view(batch, tokens, 1)
    n = x.float() * rstd
    dn = dy * weight.float()
    grad_x = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), (dy * n).sum((0, 1)).to(weight.dtype)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _setup_context(ctx, inputs, output) -> None:
    x, weight, cos, sin, _ = inputs
    ctx.save_for_backward(x, weight, cos, sin, output[1])


def _autograd_backward(ctx, grad_y: Tensor, _grad_rstd: Tensor) -> tuple[Tensor | None, ...]:
    x, weight, cos, sin, rstd = ctx.saved_tensors
    grad_x, grad_w = _backward_op(grad_y.contiguous(), x, weight, cos, sin, rstd)
    return grad_x, grad_w, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def qk_norm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """``rotate(rms_norm(x, weight))`` for ``x`` ``(B, L, H * D)``; module docstring.

    ``cos`` and ``sin`` are ``(B or 1, L, 1, D)``, as diffusers' Wan passes them; a pair takes
    its cos from its even slot and its sin from its odd one.

    Example::

        qk_norm_rope(torch.randn(1, 4, 8), torch.ones(8), cos, sin, 1e-6).shape
    """
    batch, tokens = x.shape[:2]
    if cos.dim() != 4 or cos.shape[0] not in (1, batch) or cos.shape[1:3] != (tokens, 1):
        raise ValueError(
            f"qk_norm_rope: cos and sin must be (1 or {batch}, {tokens}, 1, head_dim) for x of "
            f"shape {tuple(x.shape)}; got {tuple(cos.shape)}."
        )
    if x.stride(2) != 1 or x.stride(0) != tokens * x.stride(1):
        x = x.contiguous()  # the kernels step through rows with one stride
    return _forward(x, weight, cos.contiguous(), sin.contiguous(), eps)[0]


__all__ = ["qk_norm_rope", "reference"]
