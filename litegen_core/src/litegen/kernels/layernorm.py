"""Swap ``torch.nn.LayerNorm`` for Apex's ``FusedLayerNorm``."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["apply_fused_layernorm"]

# FusedLayerNorm(normalized_shape, eps=..., elementwise_affine=...) and anything alike.
LayerNormFactory = Callable[..., nn.Module]

_warned_missing_apex = False


def apply_fused_layernorm(model: nn.Module, *, fused_cls: LayerNormFactory | None = None) -> int:
    """Replace every ``nn.LayerNorm`` in ``model`` with Apex's ``FusedLayerNorm``, in place.

    Weights, ``elementwise_affine``, ``eps``, device, dtype and ``requires_grad`` carry over,
    so outputs stay the same. Only exact ``nn.LayerNorm`` instances are swapped (subclasses
    may change ``forward``), and LayerNorms with a weight but no bias (``bias=False``) are
    kept, since FusedLayerNorm always has both. Call it before wrapping the model
    (DDP/FSDP) and before building the optimizer: the parameters are new objects.

    Args:
        model: the model to change in place.
        fused_cls: the replacement class; defaults to ``apex.normalization.FusedLayerNorm``.

    Returns:
        How many LayerNorms were swapped; 0 (with a one-time warning) without Apex.

    Example::

        swapped = apply_fused_layernorm(model)
    """
    if fused_cls is None:
        try:
            from apex.normalization import FusedLayerNorm
        except ImportError:
            _warn_missing_apex()
            return 0
        fused_cls = FusedLayerNorm
    return _swap_layernorm(model, fused_cls)


def _swap_layernorm(model: nn.Module, fused_cls: LayerNormFactory) -> int:
    # Collect first: replacing children while iterating named_modules() is unsafe.
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.LayerNorm and not (child.weight is not None and child.bias is None)
    ]
    # One replacement per LayerNorm object, so a norm shared by two parents stays shared.
    replacements: dict[int, nn.Module] = {}
    for parent, name, norm in targets:
        if id(norm) not in replacements:
            replacements[id(norm)] = _fused_copy(norm, fused_cls)
        setattr(parent, name, replacements[id(norm)])
    return len(replacements)


def _fused_copy(norm: nn.LayerNorm, fused_cls: LayerNormFactory) -> nn.Module:
    fused = fused_cls(
        norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine
    )
    if norm.weight is not None:
        fused.to(device=norm.weight.device, dtype=norm.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(norm.weight)
            fused.bias.copy_(norm.bias)
        fused.weight.requires_grad_(norm.weight.requires_grad)
        fused.bias.requires_grad_(norm.bias.requires_grad)
    fused.train(norm.training)
    return fused


def _warn_missing_apex() -> None:
    global _warned_missing_apex
    if _warned_missing_apex:
        return
    _warned_missing_apex = True
    warnings.warn(
        "kernels.fused_layernorm is on but NVIDIA Apex is not installed; training continues "
        "with torch's LayerNorm. Build Apex from source (see docs/install.md) to use it.",
        RuntimeWarning,
        stacklevel=3,
    )
