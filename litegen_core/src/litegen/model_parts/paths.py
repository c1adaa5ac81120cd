"""Dotted module paths from the config (``exclude_paths``, ``target_paths``, ...), checked once."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def submodules_at(model: nn.Module, paths: Iterable[str], field: str) -> dict[str, nn.Module]:
    """The modules ``paths`` name; a ValueError naming ``field`` lists any that do not exist.

    Example:
        >>> dit = nn.Module()
        >>> dit.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        >>> submodules_at(dit, ["blocks.0"], "optimization.memory.activation_checkpoint.target_paths")
        {'blocks.0': Linear(in_features=8, out_features=8, bias=True)}
    """
    modules = dict(model.named_modules())
    paths = list(paths)
    unknown = [p for p in paths if p not in modules]
    if unknown:
        raise ValueError(
            f"{field} names modules that {type(model).__name__} does not have (not submodules): "
            f"{unknown}; use dotted paths from model.named_modules(), e.g. "
            f"{[n for n in modules if n][:4]}."
        )
    return {p: modules[p] for p in paths}


def is_under(name: str, paths: Iterable[str]) -> bool:
    """Whether the module ``name`` is one of ``paths`` or lies inside one of them.

    Example:
        >>> is_under("blocks.0.mlp", ["blocks.0"]), is_under("blocks.10", ["blocks.1"])
        (True, False)
    """
    return any(name == p or name.startswith(p + ".") for p in paths)


# Wrappers that insert a path component into parameter names (FSDP1, checkpoint_wrapper,
# torch.compile); names are compared without them.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name as the user's unwrapped module spells it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
