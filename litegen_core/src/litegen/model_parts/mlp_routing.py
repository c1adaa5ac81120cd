"""Find a model's ``Linear -> GELU(tanh) -> Linear`` MLPs and route them through another forward.

:func:`gelu_mlp_linears` accepts only MLPs it can prove compute exactly ``fc2(gelu_tanh(fc1(x)))``:

* an ``nn.Sequential`` of exactly ``Linear, GELU(approximate="tanh"), Linear``;
* timm's own ``Mlp`` (``fc1``, ``act``, ``fc2``) with its dropouts at 0 and no norm, which the
  reference DiT uses; a class of another library that is merely named ``Mlp`` is left alone;
* diffusers' ``FeedForward`` with ``activation_fn="gelu-approximate"`` (its ``net`` holds
  diffusers' ``GELU``, a ``Linear`` then the tanh GELU, then dropouts at 0 and a ``Linear``),
  the MLP of diffusers' DiT, PixArt, Wan and CogVideoX transformers.

Both linears need a bias. Exact GELU (``approximate="none"``) is left alone, and so is an MLP
whose layers carry hooks, parametrizations (weight norm) or a patched ``forward``, since a
routed forward would skip them.

:func:`route_gelu_mlps` swaps a matched module's class for a subclass whose ``forward`` is the
given function (the fused op of ``litegen.experimental.fused_gelu_mlp``, the chunked recompute of
``litegen.memory.mlp_token_chunks``). A class swap, not an instance ``forward``, so every block's MLP
keeps one class and the blocks still share one compiled graph; the module tree, parameter names
and ``state_dict`` keys stay the user's. A routed forward (:func:`call_routed`) checks the MLP
again at every call and runs the original forward when it has changed since (an FSDP unit
wrapped around one of its linears, a hook added, a layer replaced or sliced off).

Example::

    route_gelu_mlps(dit, my_forward)  # before compile and wrapping
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

_TIMM_MLP_NO_OPS = ("drop1", "norm", "drop2")
_ROUTED = "_litegen_routed_forward"


def _layers(module: nn.Module) -> tuple[nn.Module, ...] | None:
    """``(fc1, act, fc2)`` of a three-layer Sequential or of timm's ``Mlp``, ``(gelu, fc2)`` of
    diffusers' ``FeedForward`` (whose GELU module holds fc1), else None."""
    if base_class(type(module)) is nn.Sequential:  # not subclasses: they have their own forward
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


# Evaluated eagerly while Dynamo traces a routed forward: Dynamo reads no __qualname__ of a
# function, and without this every compiled MLP would fall back to its own forward. A class's
# answer never changes, and Dynamo guards on the module's class.
@torch.compiler.assume_constant_result
def _runs_library_forward(cls: type, qualname: str, library: str) -> bool:
    """Whether ``cls`` (or the class a routed one was made from) runs ``library``'s
    ``qualname`` as its forward; a class merely named like it is not enough."""
    forward = base_class(cls).forward
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


def gelu_mlp_linears(module: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """``(fc1, fc2)`` when ``module`` computes exactly ``fc2(gelu_tanh(fc1(x)))``, else None.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8))
        >>> fc1, fc2 = gelu_mlp_linears(mlp)
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


def base_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The class a routed class was made from; ``cls`` itself when it is not routed."""
    return cls.__bases__[0] if _ROUTED in cls.__dict__ else cls


def routed_forward(module: nn.Module) -> Callable[..., Tensor] | None:
    """The forward :func:`route_gelu_mlps` routed ``module`` through, else None.

    Example:
        >>> def traced_forward(module, x):
        ...     return original_forward(module, x)
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8))
        >>> routed_forward(mlp) is None
        True
        >>> route_gelu_mlps(mlp, traced_forward)
        1
        >>> routed_forward(mlp) is traced_forward
        True
    """
    return type(module).__dict__.get(_ROUTED)


def original_forward(module: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``module``'s forward as its own class defines it, for a routed forward to fall back on."""
    return base_class(type(module)).forward(module, x, *args, **kwargs)


def call_routed(
    module: nn.Module,
    x: Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    op: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor],
) -> Tensor:
    """``op(x, w1, b1, w2, b2)`` over ``x``'s rows for a routed MLP, or its original forward.

    The body of a routed forward: it falls back when the MLP no longer matches or gets extra
    arguments, reads the parameters at every call (so wrappers that swap them, FSDP, still
    work), and casts like ``nn.Linear`` under autocast: inputs and parameters to the autocast
    dtype, with gradients flowing back through the casts.

    Example:
        >>> def my_forward(self, x, *args, **kwargs):
        ...     return call_routed(self, x, args, kwargs, my_op)
    """
    linears = gelu_mlp_linears(module)
    if linears is None or args or kwargs:  # changed since it was routed (module docstring)
        return original_forward(module, x, *args, **kwargs)
    fc1, fc2 = linears
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    tensors = (x.reshape(-1, x.shape[-1]), fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    with torch.autocast(device, enabled=False):
        y = op(*(t.to(dtype).contiguous() for t in tensors))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _rebuild(base: type[nn.Module], forward: Callable[..., Tensor]) -> nn.Module:
    """Unpickling (and deepcopy) of a routed module: its routed class, made again."""
    module = base.__new__(base)
    module.__class__ = _routed_class(base, forward)
    return module


def _reduce_ex(self: nn.Module, protocol: int):
    # A generated class cannot be imported by name; its base (nn.Sequential, a library's) and
    # the forward (a module-level function) can.
    return _rebuild, (base_class(type(self)), routed_forward(self)), self.__dict__


@functools.cache
def _routed_class(cls: type[nn.Module], forward: Callable[..., Tensor]) -> type[nn.Module]:
    # _fused_forward routes nn.Sequential through FusedSequential, and so on.
    words = getattr(forward, "__name__", "").removesuffix("forward").split("_")
    return type(
        "".join(word.title() for word in words) + cls.__name__,
        (cls,),
        {"forward": forward, _ROUTED: forward, "__reduce_ex__": _reduce_ex, "__module__": __name__},
    )


def route_gelu_mlps(model: nn.Module, forward: Callable[..., Tensor]) -> int:
    """Route every GELU MLP of ``model`` that matches (module docstring) through ``forward``.

    ``forward(module, x)`` is a module-level function (so routed modules pickle) that calls
    :func:`original_forward` when :func:`gelu_mlp_linears` no longer matches. In place and
    idempotent; MLPs already routed through another forward are left as they are. Returns how
    many MLPs of ``model`` are routed through ``forward``, including any routed before.

    Example:
        >>> def traced_forward(module, x):
        ...     return original_forward(module, x)
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU("tanh"), nn.Linear(32, 8))
        >>> route_gelu_mlps(mlp, traced_forward)
        1
    """
    count = 0
    for module in model.modules():
        if routed_forward(module) is None and gelu_mlp_linears(module) is not None:
            module.__class__ = _routed_class(type(module), forward)
        count += routed_forward(module) is forward
    return count


__all__ = [
    "base_class",
    "call_routed",
    "gelu_mlp_linears",
    "original_forward",
    "route_gelu_mlps",
    "routed_forward",
]
