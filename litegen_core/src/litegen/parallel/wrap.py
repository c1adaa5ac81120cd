"""Wrap plans: which submodules become their own FSDP sharding unit.

One plan function per ``optimization.parallel.fsdp2.wrap_strategy``, each ``(model, cfg) ->
list[str]`` of dotted module paths. Each raises a ValueError saying what it searched for when it
matches nothing, so a typo never silently degrades to "shard only the root". ``select_wrap_units``
then applies what every strategy shares: ``exclude_paths``, the empty-unit rule, and the
bottom-up order ``fully_shard`` needs (a unit must be sharded before any unit around it).

The root module is never part of a plan: the strategy always shards it last, to own whatever
the planned units leave over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from litegen.model_parts.blocks import repeated_blocks
from litegen.model_parts.paths import is_under, submodules_at

_FIELD = "optimization.parallel.fsdp2"


def _named_modules_post_order(
    module: nn.Module, prefix: str = ""
) -> Iterator[tuple[str, nn.Module]]:
    """Like ``named_modules`` but children before parents (and each module once)."""
    seen: set[int] = set()

    def visit(mod: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for child_name, child in mod.named_children():
            yield from visit(child, f"{name}.{child_name}" if name else child_name)
        yield name, mod

    yield from visit(module, prefix)


# -- one plan per wrap_strategy --------------------------------------------------------------
def plan_manual(model: nn.Module, cfg: Any) -> list[str]:
    """The paths in ``wrap_paths``, checked against the model.

    Example:
        >>> from litegen.config.sections import FSDP2Config
        >>> dit = nn.ModuleDict({"time": nn.Linear(1, 8).requires_grad_(False),
        ...                      "blocks": nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8)})
        ...                                              for _ in range(3))})
        >>> plan_manual(dit, FSDP2Config(wrap_strategy="manual", wrap_paths=["blocks.0"]))
        ['blocks.0']
    """
    paths = list(cfg.wrap_paths)
    if not paths:
        raise ValueError(
            f"{_FIELD}.wrap_strategy 'manual' needs wrap_paths, but it is empty; list the "
            "module paths to shard (e.g. ['blocks.0', 'blocks.1']) or use wrap_strategy "
            "'repeated'."
        )
    if "" in paths:
        raise ValueError(
            f"{_FIELD}.wrap_paths lists the root module (''); the root is always sharded last, "
            "so list only submodules (dotted paths from model.named_modules())."
        )
    submodules_at(model, paths, f"{_FIELD}.wrap_paths")
    return paths


def plan_repeated(model: nn.Module, cfg: Any) -> list[str]:
    """The model's repeated blocks (``get_fsdp_wrap_module_list()`` or detected ones).

    Example:
        >>> from litegen.config.sections import FSDP2Config
        >>> dit = nn.ModuleDict({"time": nn.Linear(1, 8).requires_grad_(False),
        ...                      "blocks": nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8)})
        ...                                              for _ in range(3))})
        >>> plan_repeated(dit, FSDP2Config())
        ['blocks.0', 'blocks.1', 'blocks.2']
    """
    found = repeated_blocks(model)
    if not found:
        raise ValueError(
            f"{_FIELD}.wrap_strategy 'repeated' searched {type(model).__name__} for repeated "
            "blocks (a ModuleList/Sequential of two or more modules of one class, or "
            "get_fsdp_wrap_module_list()) and found none; implement "
            "get_fsdp_wrap_module_list() or pick wrap_strategy 'manual' with wrap_paths."
        )
    return found


def plan_size_based(model: nn.Module, cfg: Any) -> list[str]:
    """Bottom-up: a module whose not-yet-claimed parameters reach ``min_num_params`` is a unit.

    Parameters already inside a chosen descendant do not count again, so a parent becomes a
    unit only for what its units leave over (like torch's ``size_based_auto_wrap_policy``).
    Parameters under ``exclude_paths`` never count.

    Example:
        >>> from litegen.config.sections import FSDP2Config
        >>> dit = nn.ModuleDict({"time": nn.Linear(1, 8).requires_grad_(False),
        ...                      "blocks": nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8)})
        ...                                              for _ in range(3))})
        >>> plan_size_based(dit, FSDP2Config(wrap_strategy="size_based", min_num_params=50))
        ['blocks.0.attn', 'blocks.1.attn', 'blocks.2.attn']
    """
    excluded = list(cfg.exclude_paths)
    claimed: set[int] = set()
    for name, module in model.named_modules():
        if is_under(name, excluded):
            claimed.update(id(p) for p in module.parameters())  # excluded: never counted
    found: list[str] = []
    for name, module in _named_modules_post_order(model):
        if not name or is_under(name, excluded):
            continue
        own = {id(p): p.numel() for p in module.parameters() if id(p) not in claimed}
        if own and sum(own.values()) >= cfg.min_num_params:
            found.append(name)
            claimed.update(own)
    if not found:
        raise ValueError(
            f"{_FIELD}.wrap_strategy 'size_based' searched for submodules with at least "
            f"min_num_params={cfg.min_num_params} parameters and found none (the whole model "
            f"has {sum(p.numel() for p in model.parameters())}); lower min_num_params."
        )
    # Registration order; select_wrap_units puts children before parents where they nest.
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(found, key=order.__getitem__)


def plan_class_based(model: nn.Module, cfg: Any) -> list[str]:
    """Every submodule whose class name (``Block`` or ``my_pkg.models.Block``) is listed.

    Example:
        >>> from litegen.config.sections import FSDP2Config
        >>> dit = nn.ModuleDict({"time": nn.Linear(1, 8).requires_grad_(False),
        ...                      "blocks": nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8)})
        ...                                              for _ in range(3))})
        >>> cfg = FSDP2Config(wrap_strategy="class_based", wrap_class_names=["Linear"])
        >>> plan_class_based(dit, cfg)
        ['time', 'blocks.0.attn', 'blocks.1.attn', 'blocks.2.attn']
    """
    wanted = set(cfg.wrap_class_names)
    if not wanted:
        raise ValueError(
            f"{_FIELD}.wrap_strategy 'class_based' needs wrap_class_names, but it is empty; "
            "list the classes to shard, e.g. ['DiTBlock']."
        )
    found = [
        name
        for name, module in model.named_modules()
        if name
        and {type(module).__name__, f"{type(module).__module__}.{type(module).__qualname__}"}
        & wanted
    ]
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"{_FIELD}.wrap_class_names searched for classes {sorted(wanted)} and matched no "
            f"submodule; classes in this model: {present}."
        )
    return found


PLANS: dict[str, Callable[[nn.Module, Any], list[str]]] = {
    "manual": plan_manual,
    "repeated": plan_repeated,
    "size_based": plan_size_based,
    "class_based": plan_class_based,
}


# -- what every strategy shares --------------------------------------------------------------
def excluded_modules(model: nn.Module, cfg: Any) -> list[str]:
    """Check ``exclude_paths``: they must exist and be frozen (their grads are never synced).

    Example:
        >>> from litegen.config.sections import FSDP2Config
        >>> dit = nn.ModuleDict({"time": nn.Linear(1, 8).requires_grad_(False),
        ...                      "blocks": nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8)})
        ...                                              for _ in range(3))})
        >>> excluded_modules(dit, FSDP2Config(exclude_paths=["time"]))
        ['time']
    """
    modules = submodules_at(model, cfg.exclude_paths, f"{_FIELD}.exclude_paths")
    paths = list(modules)
    trainable = [p for p in paths if any(t.requires_grad for t in modules[p].parameters())]
    if trainable:
        # Excluded parameters stay replicated and outside FSDP's gradient reduction, so
        # training them would let the ranks drift apart.
        raise ValueError(
            f"{_FIELD}.exclude_paths must name frozen modules, but {trainable} have "
            "parameters with requires_grad=True; freeze them (module.requires_grad_(False)) "
            "or drop them from exclude_paths."
        )
    return paths


def select_wrap_units(model: nn.Module, cfg: Any) -> list[str]:
    """The sharding units for ``cfg.wrap_strategy``, in the order to shard them.

    Units under ``exclude_paths`` are dropped (``manual`` naming one is an error); units without
    parameters are dropped unless ``allow_empty_param_unit_sharding``. The order is post-order:
    children before the units around them, otherwise registration order.

    Example:
        >>> from litegen.config.sections import FSDP2Config
        >>> dit = nn.ModuleDict({"time": nn.Linear(1, 8).requires_grad_(False),
        ...                      "blocks": nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8)})
        ...                                              for _ in range(3))})
        >>> select_wrap_units(dit, FSDP2Config(wrap_strategy="repeated"))
        ['blocks.0', 'blocks.1', 'blocks.2']
    """
    excluded = excluded_modules(model, cfg)
    found = PLANS[cfg.wrap_strategy](model, cfg)
    inside_excluded = [p for p in found if is_under(p, excluded)]
    if inside_excluded and cfg.wrap_strategy == "manual":
        raise ValueError(
            f"{_FIELD}.wrap_paths {inside_excluded} lie inside exclude_paths {excluded}; a "
            "module cannot be both sharded and kept out of sharding, remove one of them."
        )
    modules = dict(model.named_modules())

    def has_params(path: str) -> bool:
        return any(
            not is_under(f"{path}.{n}", excluded) for n, _ in modules[path].named_parameters()
        )

    keep = {
        p
        for p in found
        if not is_under(p, excluded) and (cfg.allow_empty_param_unit_sharding or has_params(p))
    }
    if not keep:
        raise ValueError(
            f"{_FIELD}: the {cfg.wrap_strategy!r} plan matched {found}, but none of them has "
            "parameters outside exclude_paths; set allow_empty_param_unit_sharding: true to "
            "shard them anyway, or choose other units."
        )
    return in_post_order(model, keep)


def in_post_order(model: nn.Module, paths: Iterable[str]) -> list[str]:
    """``paths`` in the order ``fully_shard`` needs: children before the units around them.

    Example:
        >>> dit = nn.ModuleDict({"time": nn.Linear(1, 8).requires_grad_(False),
        ...                      "blocks": nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8)})
        ...                                              for _ in range(3))})
        >>> in_post_order(dit, ["blocks.0", "blocks.0.attn", "blocks.1"])
        ['blocks.0.attn', 'blocks.0', 'blocks.1']
    """
    chosen = set(paths)
    return [name for name, _ in _named_modules_post_order(model) if name in chosen]


def last_unit(model: nn.Module, units: list[str]) -> str | None:
    """The unit met last when walking ``model.named_modules()`` (the last block of a DiT)."""
    chosen = set(units)
    last = None
    for name, _ in model.named_modules():
        if name in chosen:
            last = name
    return last


def __getattr__(name: str) -> Any:
    # Earlier names of this module's functions, with a warning naming the new one.
    from litegen.utils.moved_modules import renamed_attribute

    return renamed_attribute(__name__, name)
