"""Frozen ``nn.Linear`` weights stored in FP8 (``float8_e4m3fn``) with a scale, for LoRA bases.

``optimization.lora.fp8_base`` replaces every frozen ``nn.Linear`` of the LoRA model (peft's
``base_layer`` of each adapted layer, and the frozen layers around them) with an
:class:`FP8Linear`: the weight is stored as ``float8_e4m3fn`` in one byte per element with one
FP32 scale per tensor (``tensorwise``) or per output row (``rowwise``), and dequantised to the
layer's original dtype at each use, one layer at a time. Backward saves the FP8 weight, not the
dequantised one, and dequantises it again for the input's gradient, so no full-precision copy
of a frozen weight outlives its layer's call. The FP8 bits are a frozen ``int8`` parameter
(``weight_fp8``; the scale is the buffer ``weight_scale``), so dtype casts pass them by, DDP
broadcasts them, and block swap (:mod:`litegen.memory.block_swap`) streams them at one byte
per element. ``int8`` is the dtype diffusers' models take for quantized storage: where they
cast an input to their first parameter's dtype (Wan's time embedder), they leave it alone.
The layer casts its input to the weight's dtype, as the layer it replaces would have needed;
``layer.weight`` is the dequantised weight, for code that reads its dtype.

E4M3 keeps 3 mantissa bits: a weight comes back within 2^-4 of its value relative, or within
2^-9 of its scale for values too small for a normal FP8 number.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448

Scaling = Literal["tensorwise", "rowwise"]


def quantize(weight: torch.Tensor, scaling: Scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale)`` with ``fp8 * scale`` close to ``weight`` (see the module's bounds).

    Example:
        >>> fp8, scale = quantize(torch.randn(4, 8), "rowwise")
        >>> fp8.dtype, scale.shape
        (torch.float8_e4m3fn, torch.Size([4, 1]))
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True) if scaling == "rowwise" else w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``fp8`` and ``scale`` stand for, in ``dtype``.

    Example:
        >>> w = torch.randn(4, 8)
        >>> (dequantize(*quantize(w, "tensorwise"), torch.float32) - w).abs().max() < 0.1
        tensor(True)
    """
    return (fp8.to(torch.float32) * scale).to(dtype)


class _FP8LinearFunction(torch.autograd.Function):
    """``x @ dequantize(w).T + b`` that saves the FP8 bits for backward; no weight gradient."""

    @staticmethod
    def forward(ctx, x, bits, scale, bias, dtype):  # type: ignore[override]
        ctx.save_for_backward(bits, scale)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        return F.linear(x, dequantize(bits.view(FP8), scale, dtype), bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        bits, scale = ctx.saved_tensors
        weight = dequantize(bits.view(FP8), scale, ctx.dtype)
        grad_x = (grad.to(weight.dtype) @ weight).to(ctx.x_dtype)
        return grad_x, None, None, None, None


class FP8Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in FP8 with a per-tensor or per-row scale.

    Example:
        >>> layer = FP8Linear.from_linear(nn.Linear(8, 4), "rowwise")
        >>> layer.fp8.dtype, layer.weight.dtype, layer(torch.randn(2, 8)).shape
        (torch.float8_e4m3fn, torch.float32, torch.Size([2, 4]))
    """

    def __init__(self, linear: nn.Linear, scaling: Scaling) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        self.scaling = scaling
        fp8, scale = quantize(linear.weight, scaling)
        # The FP8 bits as int8: not a floating-point tensor, so dtype casts (cast_model,
        # .to(dtype)) leave it alone, and the dtype diffusers' models skip when they cast an
        # input to their first parameter's dtype.
        self.weight_fp8 = nn.Parameter(fp8.view(torch.int8), requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, scaling: Scaling) -> FP8Linear:
        return cls(linear, scaling)

    @property
    def fp8(self) -> torch.Tensor:
        """The stored weight as ``float8_e4m3fn`` (a view, no copy)."""
        return self.weight_fp8.view(FP8)

    @property
    def weight(self) -> torch.Tensor:
        """The weight dequantised, for code that reads a layer's ``weight`` (its dtype, shape)."""
        return self.dequantized()

    def dequantized(self) -> torch.Tensor:
        """The weight in the dtype it had before quantization."""
        return dequantize(self.fp8, self.weight_scale, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type  # the meta device (peak estimates) has no autocast
        if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
            x = x.to(self.compute_dtype)
        if not torch.is_grad_enabled() or not x.requires_grad:  # nothing saved for backward
            return F.linear(x, self.dequantized(), self.bias)
        return _FP8LinearFunction.apply(
            x, self.weight_fp8, self.weight_scale, self.bias, self.compute_dtype
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fp8 {self.scaling}"
        )


def store_frozen_linears_in_fp8(model: nn.Module, scaling: Scaling) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` whose parameters are all frozen with an
    :class:`FP8Linear`, in place; returns their paths.

    Example::

        store_frozen_linears_in_fp8(lora_model, "tensorwise")[:1]
    """
    replaced = []
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Linear or any(p.requires_grad for p in module.parameters()):
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, FP8Linear.from_linear(module, scaling))
        # An optimizer built on model.parameters() still lists the old weight; free its data.
        module.weight.data = module.weight.data.new_empty(0)
        replaced.append(path)
    return replaced
