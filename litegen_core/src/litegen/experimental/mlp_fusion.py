"""Route a model's GELU MLPs through the fused op (``optimization.experimental.fused_gelu_mlp``).

:func:`apply_fused_gelu_mlp` changes only MLPs it can prove compute exactly
``fc2(gelu_tanh(fc1(x)))``:

* an ``nn.Sequential`` of exactly ``Linear, GELU(approximate="tanh"), Linear``;
* timm's own ``Mlp`` (``fc1``, ``act``, ``fc2``) with its dropouts at 0 and no norm, which the
  reference DiT uses; a class of another library that is merely named ``Mlp`` is left alone;
* diffusers' ``FeedForward`` with ``activation_fn="gelu-approximate"`` (its ``net`` holds
  diffusers' ``GELU``, a ``Linear`` then the tanh GELU, then dropouts at 0 and a ``Linear``),
  the MLP of diffusers' DiT, PixArt, Wan and CogVideoX transformers.

Both linears need a bias. Exact GELU (``approximate="none"``) is left alone, since the
epilogues are the tanh form. So is an MLP whose layers carry hooks, parametrizations (weight
norm) or a patched ``forward``, since the op would skip them.

A matched module's class becomes a subclass whose ``forward`` calls
:func:`litegen.experimental.gelu_mlp.gelu_mlp`: ``FusedGeluSequential``, or ``FusedGeluMlp`` made
for timm's class. It is a class swap, not an instance ``forward``, so every block's MLP keeps
one class and the blocks still share one compiled graph. The module tree, parameter names and
``state_dict`` keys stay the user's. The check runs again at every call. If the MLP has changed
since (an FSDP unit wrapped around one of its linears, a hook added, a layer replaced or sliced
off), it runs its original ``forward``.

Example:
    >>> apply_fused_gelu_mlp(dit)  # before compile and wrapping, as prepare does
    28
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from litegen.experimental.gelu_mlp import gelu_mlp

_TIMM_MLP_NO_OPS = ("drop1", "norm", "drop2")


def _layers(module: nn.Module) -> tuple[nn.Module, ...] | None:
    """``(fc1, act, fc2)`` of a three-layer Sequential or of timm's ``Mlp``, ``(gelu, fc2)`` of
    diffusers' ``FeedForward`` (whose GELU module holds fc1), else None."""
    if _base(type(module)) is nn.Sequential:  # not subclasses: they have a forward of their own
        return tuple(module) if len(module) == 3 else None
    if _runs_library_forward(type(module), "Mlp.forward", "timm.") and all(
        _is_no_op(getattr(module, name, None)) for name in _TIMM_MLP_NO_OPS
    ):
        return module.fc1, module.act, module.fc2
    if _runs_library_forward(type(module), "FeedForward.forward", "diffusers."):
        net = list(getattr(module, "net", []))
        if len(net) >= 3 and all(_is_no_op(m) for m in net[1:2] + net[3:]):
            return net[0], net[2]
    return None


def _runs_library_forward(cls: type, qualname: str, library: str) -> bool:
    """Whether ``cls`` (or the class a fused one was made from) runs ``library``'s
    ``qualname`` as its forward; a class merely named like it is not enough."""
    forward = _base(cls).forward
    # getattr: a class's forward may be any callable (a partial, a scripted method).
    name, module = getattr(forward, "__qualname__", ""), getattr(forward, "__module__", "")
    return name == qualname and (module or "").startswith(library)


def _diffusers_tanh_gelu(module: nn.Module) -> nn.Linear | None:
    """The ``proj`` of diffusers' ``GELU(approximate="tanh")``, else None."""
    if not _runs_library_forward(type(module), "GELU.forward", "diffusers."):
        return None
    proj = getattr(module, "proj", None)
    return proj if getattr(module, "approximate", None) == "tanh" else None


def _is_no_op(module: nn.Module | None) -> bool:
    return (
        module is None
        or type(module) is nn.Identity
        or (type(module) is nn.Dropout and module.p == 0)
    )


def _runs_its_class_forward(module: nn.Module) -> bool:
    """Calling ``module`` runs just its class's ``forward``: no hooks, no parametrization."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or "forward" in module.__dict__
        or parametrize.is_parametrized(module)
    )


def fusable_linears(module: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """``(fc1, fc2)`` when ``module`` computes exactly ``fc2(gelu_tanh(fc1(x)))``, else None.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8))
        >>> fc1, fc2 = fusable_linears(mlp)
    """
    layers = _layers(module)
    if layers is None or "forward" in module.__dict__:
        return None
    if len(layers) == 2:  # diffusers' FeedForward: GELU(proj), then fc2
        fc1, fc2 = _diffusers_tanh_gelu(layers[0]), layers[1]
        layers = (*layers, fc1)
    else:
        fc1, act, fc2 = layers
        if type(act) is not nn.GELU or act.approximate != "tanh":
            return None
    if not (type(fc1) is nn.Linear and type(fc2) is nn.Linear):
        return None
    if fc1.bias is None or fc2.bias is None:
        return None
    if fc1.out_features != fc2.in_features:
        return None
    return (fc1, fc2) if all(_runs_its_class_forward(m) for m in layers) else None


def _fused_forward(self: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    # Reads the parameters at every call, so wrappers that swap them (FSDP) still work.
    linears = fusable_linears(self)
    if linears is None or args or kwargs:  # changed since it was fused (module docstring)
        return _base(type(self)).forward(self, x, *args, **kwargs)
    fc1, fc2 = linears
    # Casts like nn.Linear under autocast: inputs and parameters to the autocast dtype, with
    # gradients flowing back through the casts.
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    tensors = (x.reshape(-1, x.shape[-1]), fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    with torch.autocast(device, enabled=False):
        y, _, _ = gelu_mlp(*(t.to(dtype).contiguous() for t in tensors))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _base(cls: type[nn.Module]) -> type[nn.Module]:
    """The class a fused class was made from; ``cls`` itself when it is not fused."""
    return cls.__bases__[0] if cls.forward is _fused_forward else cls


def _rebuild(base: type[nn.Module]) -> nn.Module:
    """Unpickling (and deepcopy) of a fused module: its fused class, made again."""
    module = base.__new__(base)
    module.__class__ = _fused_class(base)
    return module


def _reduce_ex(self: nn.Module, protocol: int):
    # A generated class cannot be imported by name; its base (nn.Sequential, a library's) can.
    return _rebuild, (_base(type(self)),), self.__dict__


@functools.cache
def _fused_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The fused subclass of ``cls`` (``nn.Sequential``, timm's ``Mlp``, diffusers'
    ``FeedForward``)."""
    return type(
        f"FusedGelu{cls.__name__}",
        (cls,),
        {"forward": _fused_forward, "__reduce_ex__": _reduce_ex, "__module__": __name__},
    )


FusedGeluSequential = _fused_class(nn.Sequential)


def is_fused(module: nn.Module) -> bool:
    """Whether :func:`apply_fused_gelu_mlp` routed ``module``.

    Example:
        >>> is_fused(dit.blocks[0].mlp)
        True
    """
    return type(module).forward is _fused_forward


def apply_fused_gelu_mlp(model: nn.Module) -> int:
    """Route every GELU MLP of ``model`` that matches (module docstring) through the fused op.

    In place and idempotent; call before compile and wrapping, as ``prepare`` does. Returns how
    many MLPs of ``model`` are routed, including any routed before.

    Example:
        >>> apply_fused_gelu_mlp(nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8)))
        1
    """
    count = 0
    for module in model.modules():
        if not is_fused(module) and fusable_linears(module) is not None:
            module.__class__ = _fused_class(type(module))
        count += is_fused(module)
    return count


__all__ = ["FusedGeluSequential", "apply_fused_gelu_mlp", "fusable_linears", "is_fused"]
