"""Route a model's GELU MLPs through the fused op (``optimization.experimental.fused_gelu_mlp``).

:func:`apply_fused_gelu_mlp` changes only the MLPs :func:`litegen.model_parts.mlp_routing.gelu_mlp_linears`
proves compute exactly ``fc2(gelu_tanh(fc1(x)))`` (diffusers' ``FeedForward`` with
``gelu-approximate``, timm's ``Mlp``, a ``Linear, GELU(tanh), Linear`` Sequential), routing them
through :func:`litegen.experimental.fused_gelu_mlp_op.gelu_mlp` with the class swap of
:mod:`litegen.model_parts.mlp_routing`: the module tree, parameter names and ``state_dict`` keys stay the
user's, and an MLP changed since (an FSDP unit around one of its linears, a hook) runs its own
forward again.

Example::

    apply_fused_gelu_mlp(dit)  # before compile and wrapping, as prepare does
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from litegen.experimental.fused_gelu_mlp_op import gelu_mlp
from litegen.model_parts.mlp_routing import call_routed, route_gelu_mlps, routed_forward


def _fused_forward(self: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return call_routed(self, x, args, kwargs, lambda *tensors: gelu_mlp(*tensors)[0])


def is_fused(module: nn.Module) -> bool:
    """Whether :func:`apply_fused_gelu_mlp` routed ``module``.

    Example::

        is_fused(dit.blocks[0].mlp)
    """
    return routed_forward(module) is _fused_forward


def apply_fused_gelu_mlp(model: nn.Module) -> int:
    """Route every GELU MLP of ``model`` that matches (module docstring) through the fused op.

    In place and idempotent; call before compile and wrapping, as ``prepare`` does. Returns how
    many MLPs of ``model`` are routed, including any routed before.

    Example:
        >>> apply_fused_gelu_mlp(nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8)))
        1
    """
    return route_gelu_mlps(model, _fused_forward)


__all__ = ["apply_fused_gelu_mlp", "is_fused"]
