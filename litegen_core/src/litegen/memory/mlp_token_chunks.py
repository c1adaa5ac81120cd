"""GELU MLPs that keep only their input and run a chunk of tokens at a time
(``optimization.memory.mlp_chunk_tokens``).

An MLP widens every token (4x in DiT, 5.8x in Wan 2.1 1.3B), and autograd keeps two of its wide
tensors for backward (the pre-activation and the GELU output), while its backward makes two more.
At long sequences they are most of what one block needs at once, which is what a checkpointed
(and offloaded) model holds at its peak: one block's recompute and backward.

:func:`chunked_gelu_mlp` saves only the MLP's input ``x``. Its forward computes the output a
chunk of rows (tokens) at a time; its backward recomputes each chunk's pre-activation from ``x``
and takes that chunk's gradients at once, accumulating the weight and bias gradients in FP32. So
the MLP's wide tensors never exceed one chunk, for one more GEMM per MLP in backward (the
first linear's), a small share of a block's work at the sequence lengths where it matters.
Results equal the plain MLP's up to the rounding of summing the weight gradients per chunk.

The op is opaque to ``torch.compile`` (a custom op), so inductor keeps the chunks as they are.
:func:`apply_chunked_mlp` routes a model's Linear-GELU(tanh)-Linear MLPs through it
(:mod:`litegen.model_parts.mlp_routing`); ``apply_memory_optimizations`` calls it.

Example:
    >>> from torch import nn
    >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8))
    >>> apply_chunked_mlp(mlp, chunk_tokens=16384)
    1
    >>> mlp(torch.randn(2, 40000, 8)).shape  # 80,000 tokens, 16,384 at a time
    torch.Size([2, 40000, 8])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula

from litegen.model_parts.mlp_routing import call_routed, route_gelu_mlps, routed_forward

_CHUNK_ATTR = "_litegen_mlp_chunk_tokens"


def _chunks(rows: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


@torch.library.custom_op("litegen::chunked_gelu_mlp", mutates_args=())
def chunked_gelu_mlp(
    x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, chunk_tokens: int
) -> Tensor:
    """``gelu_tanh(x @ w1.T + b1) @ w2.T + b2`` for 2-D ``x``, ``chunk_tokens`` rows at a time.

    Example::

        y = chunked_gelu_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, 4096)
    """
    y = x.new_empty(x.shape[0], w2.shape[0])
    for rows in _chunks(x.shape[0], chunk_tokens):
        hidden = F.gelu(F.linear(x[rows], w1, b1), approximate="tanh")
        torch.addmm(b2, hidden, w2.t(), out=y[rows])
    return y


@chunked_gelu_mlp.register_fake
def _(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, chunk_tokens: int) -> Tensor:
    return x.new_empty(x.shape[0], w2.shape[0])


@torch.library.custom_op("litegen::chunked_gelu_mlp_backward", mutates_args=())
def chunked_gelu_mlp_backward(
    grad_y: Tensor, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, chunk_tokens: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`chunked_gelu_mlp` for ``(x, w1, b1, w2, b2)``, chunk by chunk."""
    fp32 = torch.float32
    grad_x = torch.empty_like(x)
    grad_w1, grad_w2 = torch.zeros_like(w1, dtype=fp32), torch.zeros_like(w2, dtype=fp32)
    grad_b1, grad_b2 = b1.new_zeros(b1.shape, dtype=fp32), w2.new_zeros(w2.shape[0], dtype=fp32)
    for rows in _chunks(x.shape[0], chunk_tokens):
        x_rows, grad_y_rows = x[rows], grad_y[rows]
        pre = F.linear(x_rows, w1, b1)
        grad_pre = torch.ops.aten.gelu_backward(grad_y_rows @ w2, pre, approximate="tanh")
        torch.mm(grad_pre, w1, out=grad_x[rows])
        grad_w1 += grad_pre.t() @ x_rows
        grad_b1 += grad_pre.sum(0, dtype=fp32)
        grad_w2 += grad_y_rows.t() @ F.gelu(pre, approximate="tanh")
        grad_b2 += grad_y_rows.sum(0, dtype=fp32)
    return (
        grad_x,
        grad_w1.to(w1.dtype),
        grad_b1.to(b1.dtype),
        grad_w2.to(w2.dtype),
        grad_b2.to(w2.dtype),
    )


@chunked_gelu_mlp_backward.register_fake
def _(
    grad_y: Tensor, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, chunk_tokens: int
) -> tuple[Tensor, ...]:
    return (
        torch.empty_like(x),
        torch.empty_like(w1),
        torch.empty_like(b1),
        torch.empty_like(w2),
        w2.new_empty(w2.shape[0]),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, w1, b1, w2, _, chunk_tokens = inputs
    ctx.save_for_backward(x, w1, b1, w2)
    ctx.chunk_tokens = chunk_tokens


def _backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
    x, w1, b1, w2 = ctx.saved_tensors
    grads = chunked_gelu_mlp_backward(grad_y.contiguous(), x, w1, b1, w2, ctx.chunk_tokens)
    return (*grads, None)


chunked_gelu_mlp.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.litegen.chunked_gelu_mlp)
def _forward_flops(x, w1, b1, w2, b2, *args, **kwargs) -> int:
    return 2 * x[0] * w1[0] * (x[1] + w2[0])


@register_flop_formula(torch.ops.litegen.chunked_gelu_mlp_backward)
def _backward_flops(grad_y, x, w1, b1, w2, *args, **kwargs) -> int:
    # The model's FLOPs (input and weight gradients of both GEMMs), as for a plain MLP: MFU
    # does not count recomputation, here no more than under activation checkpointing.
    return 4 * x[0] * w1[0] * (x[1] + w2[0])


def _chunked_forward(self: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    chunk_tokens = getattr(self, _CHUNK_ATTR)
    return call_routed(self, x, args, kwargs, lambda *t: chunked_gelu_mlp(*t, chunk_tokens))


def is_chunked(module: nn.Module) -> bool:
    """Whether :func:`apply_chunked_mlp` routed ``module``.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8))
        >>> is_chunked(mlp), apply_chunked_mlp(mlp, 4), is_chunked(mlp)
        (False, 1, True)
    """
    return routed_forward(module) is _chunked_forward


def apply_chunked_mlp(model: nn.Module, chunk_tokens: int) -> int:
    """Route every Linear-GELU(tanh)-Linear MLP of ``model`` through :func:`chunked_gelu_mlp`.

    The MLPs matched are those of :func:`litegen.model_parts.mlp_routing.gelu_mlp_linears` (diffusers'
    ``FeedForward`` with ``gelu-approximate``: DiT, PixArt, Wan, CogVideoX, LTX-Video); MLPs
    already routed elsewhere (the fused GELU MLP) are left alone. In place; calling it again
    sets the new chunk size. Returns how many MLPs are chunked.

    Example:
        >>> apply_chunked_mlp(nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8)), 4)
        1
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}.")
    count = route_gelu_mlps(model, _chunked_forward)
    for module in model.modules():
        if is_chunked(module):
            setattr(module, _CHUNK_ATTR, chunk_tokens)
    return count


__all__ = ["apply_chunked_mlp", "chunked_gelu_mlp", "chunked_gelu_mlp_backward", "is_chunked"]
