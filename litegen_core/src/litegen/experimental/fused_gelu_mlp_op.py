"""The fused GELU MLP op: ``Linear -> GELU(tanh) -> Linear`` with the activation in the GEMMs.

A DiT block's MLP is ``Linear -> GELU(tanh) -> Linear``. Compiled, its GEMMs are cuBLAS and its
GELU is a Triton kernel of its own in each direction, a full pass over the 4x-wide hidden
activation; inductor cannot move that work into cuBLAS. This op does it in cuBLASLt's GEMM
epilogues (:mod:`litegen.experimental.cublaslt`):

* forward: ``pre, h = x @ w1.T + b1, gelu(pre)`` in the first GEMM (``GELU_AUX_BIAS``), then
  ``h @ w2.T + b2``;
* backward: ``grad_pre = (grad_y @ w2) * gelu'(pre)`` in one GEMM (``DGELU``), then the
  weight and input gradients as plain GEMMs and the bias gradients as GEMVs (:func:`sum_rows`).

It saves what inductor saves for this MLP (``x``, ``pre``, ``h``). A frozen MLP (the base of a
LoRA run) saves ``pre`` alone and its backward is the ``DGELU`` GEMM and the input gradient's:
the weight gradients, half of an MLP's backward, are not computed. The pair is one custom op
(``litegen::gelu_mlp``, with its backward op), opaque to ``torch.compile``, with FLOP formulas
so MFU still counts it. Off CUDA, in fp32, for non-contiguous or mixed-dtype inputs, or when
cuBLASLt does not serve a shape, the same ops run with torch's kernels.
:mod:`litegen.experimental.fused_gelu_mlp` routes a model's MLPs through it.

Example::

    y, pre, h = gelu_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)  # x: (tokens, in)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from litegen.experimental import cublaslt


@torch.library.custom_op("litegen::gelu_mlp", mutates_args=())
def gelu_mlp(
    x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, pre, h)`` of ``y = gelu_tanh(x @ w1.T + b1) @ w2.T + b2`` for 2-D ``x``."""
    fused = cublaslt.gelu_aux_bias(x, w1, b1)
    if fused is None:
        pre = F.linear(x, w1, b1)
        fused = pre, F.gelu(pre, approximate="tanh")
    pre, h = fused
    return F.linear(h, w2, b2), pre, h


@gelu_mlp.register_fake
def _(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    hidden = x.new_empty(x.shape[0], w1.shape[0])
    return x.new_empty(x.shape[0], w2.shape[0]), hidden, torch.empty_like(hidden)


@torch.library.custom_op("litegen::gelu_mlp_backward", mutates_args=())
def gelu_mlp_backward(
    grad_y: Tensor, x: Tensor, w1: Tensor, w2: Tensor, pre: Tensor, h: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`gelu_mlp`'s ``y`` for ``(x, w1, b1, w2, b2)``."""
    grad_pre = _grad_pre(grad_y, w2, pre)
    # The bias gradients as GEMVs of their own: cuBLASLt's DGELU_BGRAD and BGRADB epilogues,
    # which would fold them into the GEMMs, measured slower (benchmarks/).
    return grad_pre @ w1, grad_pre.t() @ x, sum_rows(grad_pre), grad_y.t() @ h, sum_rows(grad_y)


def sum_rows(matrix: Tensor) -> Tensor:
    """``matrix.sum(0)`` as a matrix-vector product with ones, for a bias gradient.

    cuBLAS's GEMV reads the matrix faster than torch's column reduction, with the same result
    (benchmarks/). Both accumulate in FP32.

    Example:
        >>> sum_rows(torch.ones(4, 3))
        tensor([4., 4., 4.])
    """
    return torch.mv(matrix.t(), matrix.new_ones(matrix.shape[0]))


@gelu_mlp_backward.register_fake
def _(
    grad_y: Tensor, x: Tensor, w1: Tensor, w2: Tensor, pre: Tensor, h: Tensor
) -> tuple[Tensor, ...]:
    return (
        torch.empty_like(x),
        torch.empty_like(w1),
        w1.new_empty(w1.shape[0]),
        torch.empty_like(w2),
        w2.new_empty(w2.shape[0]),
    )


@torch.library.custom_op("litegen::gelu_mlp_input_backward", mutates_args=())
def gelu_mlp_input_backward(grad_y: Tensor, w1: Tensor, w2: Tensor, pre: Tensor) -> Tensor:
    """The gradient of :func:`gelu_mlp`'s ``y`` for ``x`` alone (frozen weights)."""
    return _grad_pre(grad_y, w2, pre) @ w1


def _grad_pre(grad_y: Tensor, w2: Tensor, pre: Tensor) -> Tensor:
    """``(grad_y @ w2) * gelu'(pre)``: cuBLASLt's ``DGELU`` GEMM, else torch's two ops."""
    grad_pre = cublaslt.dgelu(grad_y, w2, pre)
    if grad_pre is None:
        grad_pre = torch.ops.aten.gelu_backward(grad_y @ w2, pre, approximate="tanh")
    return grad_pre


@gelu_mlp_input_backward.register_fake
def _(grad_y: Tensor, w1: Tensor, w2: Tensor, pre: Tensor) -> Tensor:
    return grad_y.new_empty(grad_y.shape[0], w1.shape[1])


def _trains_weights(ctx) -> bool:
    return any(ctx.needs_input_grad[1:])


def _setup_context(ctx, inputs, output) -> None:
    x, w1, _, w2, _ = inputs
    _, pre, h = output
    # A frozen MLP's backward reads neither x nor h: not saving them frees both for the step.
    if _trains_weights(ctx):
        ctx.save_for_backward(x, w1, w2, pre, h)
    else:
        ctx.save_for_backward(w1, w2, pre)


def _backward(ctx, grad_y: Tensor, _grad_pre: Tensor, _grad_h: Tensor) -> tuple[Tensor, ...]:
    if _trains_weights(ctx):
        x, w1, w2, pre, h = ctx.saved_tensors
        return gelu_mlp_backward(grad_y.contiguous(), x, w1, w2, pre, h)
    w1, w2, pre = ctx.saved_tensors
    return gelu_mlp_input_backward(grad_y.contiguous(), w1, w2, pre), None, None, None, None


gelu_mlp.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.litegen.gelu_mlp)
def _forward_flops(x, w1, b1, w2, b2, *args, **kwargs) -> int:
    return 2 * x[0] * w1[0] * (x[1] + w2[0])


@register_flop_formula(torch.ops.litegen.gelu_mlp_backward)
def _backward_flops(grad_y, x, w1, w2, pre, h, *args, **kwargs) -> int:
    return 4 * x[0] * w1[0] * (x[1] + w2[0])  # input and weight gradients of both GEMMs


@register_flop_formula(torch.ops.litegen.gelu_mlp_input_backward)
def _input_backward_flops(grad_y, w1, w2, pre, *args, **kwargs) -> int:
    return 2 * grad_y[0] * w1[0] * (w1[1] + w2[0])  # input gradients of both GEMMs


__all__ = ["gelu_mlp", "gelu_mlp_backward", "gelu_mlp_input_backward", "sum_rows"]
