"""Fused GELU MLPs (``optimization.kernels.fused_gelu_mlp``): the activation inside the GEMMs.

A DiT block's MLP is ``Linear -> GELU(tanh) -> Linear``. Compiled, its GEMMs are cuBLAS and its
GELU is a Triton kernel of its own in each direction, a full pass over the 4x-wide hidden
activation: on workload C (issue 8) 5.6 ms forward and 9.4 ms backward of a 206 ms step. Fused,
that step measured 2.8-3.0% shorter (docs/benchmarks.md). Inductor
cannot move that work into cuBLAS, and its own Triton GEMMs are slower than cuBLAS here (its
autotuning keeps cuBLAS), so the fusion is left undone. This module does it with cuBLASLt's
epilogues (:mod:`litegen.kernels.cublaslt`):

* forward: ``pre, h = x @ w1.T + b1, gelu(pre)`` in the first GEMM (``GELU_AUX_BIAS``), then
  ``h @ w2.T + b2``;
* backward: ``grad_pre = (grad_y @ w2) * gelu'(pre)`` in one GEMM (``DGELU``), then ``b1``'s
  gradient as a sum and the weight and input gradients as plain GEMMs.

It saves what inductor saves for this MLP (``x``, ``pre``, ``h``). The pair is one custom op
(``litegen::gelu_mlp``, with its backward op), opaque to ``torch.compile``, with FLOP formulas
so MFU still counts it. Off CUDA, in fp32, or when cuBLASLt has no algorithm for a shape, the
same ops run with torch's kernels.

:func:`apply_fused_gelu_mlp` routes MLPs it can prove equal through the op: an ``nn.Sequential``
of exactly ``Linear, GELU(approximate="tanh"), Linear``, and timm's ``Mlp`` (``fc1``, ``act``,
``fc2``, with no dropout or norm), which the reference DiT uses. Both linears need a bias.
Exact GELU (``approximate="none"``) is left alone: cuBLASLt's epilogue is the tanh form. The
module tree, parameter names and ``state_dict`` keys stay the user's; only the matched modules'
class changes, to a subclass whose ``forward`` calls the op (``FusedGeluSequential``, or a
``FusedGelu<Name>`` subclass made for a timm-style class).

Example:
    >>> apply_fused_gelu_mlp(dit)  # before compile and wrapping, like prepare does
    28
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula

from litegen.kernels import cublaslt


def _fusable_on_gpu(*tensors: Tensor) -> bool:
    # cuBLASLt's epilogues want 16-byte aligned rows: bf16/fp16 dims that are multiples of 8.
    return all(
        t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and t.shape[-1] % 8 == 0
        for t in tensors
    )


@torch.library.custom_op("litegen::gelu_mlp", mutates_args=())
def gelu_mlp(
    x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, pre, h)`` of ``y = gelu_tanh(x @ w1.T + b1) @ w2.T + b2`` for 2-D ``x``."""
    fused = cublaslt.gelu_aux_bias(x, w1, b1) if _fusable_on_gpu(x, w1, b1) else None
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
    grad_pre = cublaslt.dgelu(grad_y, w2, pre) if _fusable_on_gpu(grad_y, w2, pre) else None
    if grad_pre is None:
        grad_pre = torch.ops.aten.gelu_backward(grad_y @ w2, pre, approximate="tanh")
    # b1's gradient as a plain sum: cuBLASLt's DGELU_BGRAD epilogue, which would add it, ran as a
    # separate kernel, 2.6x slower than DGELU and this sum together (docs/benchmarks.md).
    grad_b1 = grad_pre.sum(0)
    return grad_pre @ w1, grad_pre.t() @ x, grad_b1, grad_y.t() @ h, grad_y.sum(0)


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


def _setup_context(ctx, inputs, output) -> None:
    x, w1, _, w2, _ = inputs
    _, pre, h = output
    ctx.save_for_backward(x, w1, w2, pre, h)


def _backward(ctx, grad_y: Tensor, _grad_pre: Tensor, _grad_h: Tensor) -> tuple[Tensor, ...]:
    x, w1, w2, pre, h = ctx.saved_tensors
    return gelu_mlp_backward(grad_y.contiguous(), x, w1, w2, pre, h)


gelu_mlp.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.litegen.gelu_mlp)
def _forward_flops(x, w1, b1, w2, b2, *args, **kwargs) -> int:
    return 2 * x[0] * w1[0] * (x[1] + w2[0])


@register_flop_formula(torch.ops.litegen.gelu_mlp_backward)
def _backward_flops(grad_y, x, w1, w2, pre, h, *args, **kwargs) -> int:
    return 4 * x[0] * w1[0] * (x[1] + w2[0])  # input and weight gradients of both GEMMs


def fused_gelu_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The ``forward`` of a routed MLP: its two linears through :func:`gelu_mlp`.

    Reads the linears' parameters at every call, so wrappers that swap them (FSDP) still work.
    Under autocast it casts like ``nn.Linear`` would: inputs and parameters to the autocast
    dtype, with gradients flowing back through the casts.
    """
    fc1, fc2 = (getattr(self, name) for name in self._litegen_linears)
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    tensors = (x.reshape(-1, x.shape[-1]), fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    with torch.autocast(device, enabled=False):
        y, _, _ = gelu_mlp(*(t.to(dtype).contiguous() for t in tensors))
    return y.reshape(*x.shape[:-1], y.shape[-1])


class FusedGeluSequential(nn.Sequential):
    """``nn.Sequential(Linear, GELU(tanh), Linear)`` routed through :func:`gelu_mlp`."""

    _litegen_linears = ("0", "2")
    forward = fused_gelu_mlp_forward


@functools.cache
def _fused_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of a timm-style ``Mlp`` class whose ``forward`` is the fused one."""
    return type(
        f"FusedGelu{cls.__name__}",
        (cls,),
        {"_litegen_linears": ("fc1", "fc2"), "forward": fused_gelu_mlp_forward},
    )


def is_fused(module: nn.Module) -> bool:
    """Whether :func:`apply_fused_gelu_mlp` routed ``module``."""
    return hasattr(type(module), "_litegen_linears")


def _mlp_linears(module: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """``(fc1, fc2)`` when ``module`` computes exactly ``fc2(gelu_tanh(fc1(x)))``, else None."""
    if type(module) is nn.Sequential and len(module) == 3:
        fc1, act, fc2 = module
    elif type(module).__name__ == "Mlp" and all(hasattr(module, n) for n in ("fc1", "act", "fc2")):
        extras = [getattr(module, n, None) for n in ("drop1", "norm", "drop2", "drop")]
        if not all(_is_identity(e) for e in extras):
            return None
        fc1, act, fc2 = module.fc1, module.act, module.fc2
    else:
        return None
    linears = type(fc1) is nn.Linear and type(fc2) is nn.Linear
    if not (linears and fc1.bias is not None and fc2.bias is not None):
        return None
    if type(act) is not nn.GELU or act.approximate != "tanh":
        return None
    return (fc1, fc2) if fc1.out_features == fc2.in_features else None


def _is_identity(module: nn.Module | None) -> bool:
    return (
        module is None
        or type(module) is nn.Identity
        or (type(module) is nn.Dropout and module.p == 0)
    )


def apply_fused_gelu_mlp(model: nn.Module) -> int:
    """Route every GELU MLP of ``model`` that matches (module docstring) through the fused op.

    In place and idempotent; call before compile and wrapping, as ``prepare`` does. Returns how
    many MLPs were routed.

    Example:
        >>> apply_fused_gelu_mlp(nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8)))
        1
    """
    count = 0
    for module in model.modules():
        if is_fused(module) or _mlp_linears(module) is None:
            continue
        # A class swap, not an instance ``forward``: every block's MLP keeps one class, so the
        # blocks still share one compiled graph; parameters and their names are untouched.
        sequential = type(module) is nn.Sequential
        module.__class__ = FusedGeluSequential if sequential else _fused_class(type(module))
        count += 1
    return count


__all__ = ["FusedGeluSequential", "apply_fused_gelu_mlp", "gelu_mlp", "is_fused"]
