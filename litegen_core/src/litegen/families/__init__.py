"""Model families: one module per family of diffusers pipelines, and their registry.

A family module (``wan.py``, ``flux.py``) defines one :class:`~litegen.families.base.Family`
subclass: its pipeline and transformer classes, latent rules, conditions, training forward,
sequence-parallel plan, tiny configuration and sampling. The registry finds every such class in
this package, so adding a family is one module (and its test): see docs/architecture.md.

Example::

    from litegen.families import family_for_pipeline, family_for_transformer

    family_for_pipeline("WanPipeline").name                 # 'wan'
    family_for_transformer("FluxTransformer2DModel").name   # 'flux'
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from typing import Any

from litegen.families.base import Family, LatentRules, MediaCondition
from litegen.model_keys.key_map import KeyMap

# This package's modules that declare no family: not imported by the registry (so the
# registry stays torch-free whatever they import).
NOT_FAMILIES = frozenset(
    {"base", "packing", "tiny_text", "tiny_qwen", "tiny_flux2", "key_map", "original_format"}
)


@functools.cache
def families() -> dict[str, type[Family]]:
    """Every family of this package by its short name, in name order."""
    found: dict[str, type[Family]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in NOT_FAMILIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            declared = issubclass(cls, Family) and cls.__module__ == module.__name__
            if declared and getattr(cls, "pipeline_class", None):
                found[cls.name] = cls
    return dict(sorted(found.items()))


def _choices() -> str:
    return ", ".join(f"{cls.name} ({cls.pipeline_class})" for cls in families().values())


def family_named(name: str) -> type[Family]:
    """The family called ``name`` (``wan``, ``flux``); ValueError naming those that exist."""
    if name not in families():
        raise ValueError(f"no model family {name!r}; the families are {_choices()}.")
    return families()[name]


def family_for_pipeline(
    pipeline_class: str, model_index: dict[str, Any] | None = None
) -> type[Family]:
    """The family of a pipeline class (``model_index.json``'s ``_class_name``); ValueError
    naming the families that exist when none trains it. Where families share a class (Wan 2.1,
    Wan 2.2's two experts), ``model_index`` (the whole ``model_index.json``) picks the one
    whose :attr:`~Family.model_index_keys` it sets, the most specific first.

    Example:
        >>> family_for_pipeline("WanPipeline").transformer_class
        'WanTransformer3DModel'
        >>> family_for_pipeline("WanPipeline", {"transformer_2": ["diffusers", "WanTransformer3DModel"],
        ...                                     "boundary_ratio": 0.875}).name
        'wan22'
    """
    found = [cls for cls in families().values() if cls.pipeline_class == pipeline_class]
    found.sort(key=lambda cls: -len(cls.model_index_keys))
    for cls in found:
        if cls.matches(model_index or {}):
            return cls
    raise ValueError(
        f"no model family trains a {pipeline_class}; the families are {_choices()} "
        "(add one: docs/architecture.md, Adding things)."
    )


def family_for_transformer(transformer_class: str) -> type[Family]:
    """The family whose trained transformer is of class ``transformer_class`` (the first by
    name where several share it, as Wan's text- and image-to-video do: they share its key map
    and sequence plan); ValueError naming the families that exist when none is.

    Example:
        >>> family_for_transformer("FluxTransformer2DModel").name
        'flux'
    """
    for cls in families().values():
        if cls.transformer_class == transformer_class:
            return cls
    raise ValueError(
        f"no model family trains a {transformer_class}; the families are {_choices()}."
    )


def key_map_for(transformer: Any) -> KeyMap | None:
    """The original-checkpoint key map of a transformer (its class name, or the model, also
    when wrapped by ``fully_shard``), or None when no family trains that class or its family
    has no map.

    Example:
        >>> key_map_for("FluxTransformer2DModel").lora_names
        ('lora_down', 'lora_up')
    """
    # fully_shard makes a subclass FSDP<Class>: the model's own class is further up its MRO.
    names = (
        [transformer]
        if isinstance(transformer, str)
        else [cls.__name__ for cls in type(transformer).__mro__]
    )
    for name in names:
        found = [cls for cls in families().values() if cls.transformer_class == name]
        if found:
            return found[0].original_keys
    return None


def original_format_classes() -> list[str]:
    """The transformer classes whose original checkpoint layout LiteGen writes."""
    return sorted({cls.transformer_class for cls in families().values() if cls.original_keys})


__all__ = [
    "Family",
    "LatentRules",
    "MediaCondition",
    "families",
    "family_for_pipeline",
    "family_for_transformer",
    "family_named",
    "key_map_for",
    "original_format_classes",
]
