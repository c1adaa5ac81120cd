"""The ``optimization`` section: its subsections put together, named profiles merged over
them, and the precision presets expanded.

Import the public names from :mod:`litegen.config`. It must never import torch (the CLI
imports it for fast validation).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, create_model, field_validator, model_validator

from litegen.config.base import ConfigError, ProfileSection, Section
from litegen.config.memory import MemoryConfig
from litegen.config.sections import (
    PRECISION_PRESETS,
    CompileConfig,
    ExperimentalConfig,
    KernelsConfig,
    LoRAConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    rename_deprecated_options,
)


@functools.cache
def profile_model(section: type[Section]) -> type[ProfileSection]:
    """Partial twin of ``section``: same fields and constraints, all optional.

    Defaults are ``None`` and never validated, so an explicit ``null`` is still checked
    against the real type. ``profile_model(OptimizationConfig)`` is ``OptimizationProfile``.
    """
    fields: dict[str, Any] = {}
    for name, info in section.model_fields.items():
        if name == "profiles":
            continue
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            fields[name] = (profile_model(ann), Field(None, description=info.description))
        else:
            if info.metadata:
                ann = Annotated[(ann, *info.metadata)]
            fields[name] = (ann, Field(None, description=info.description))
    name = section.__name__.removesuffix("Config") + "Profile"
    doc = f"Partial ``{section.__name__}`` inside ``optimization.profiles``."
    return create_model(name, __base__=ProfileSection, __doc__=doc, **fields)


def value_at(data: Any, *keys: str) -> Any:
    """``data[k0][k1]...`` of nested mappings, or None where a level is missing."""
    for key in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class OptimizationConfig(Section):
    """Performance options (``optimization``); ``profiles`` holds named partial overrides."""

    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    experimental: ExperimentalConfig = Field(default_factory=ExperimentalConfig)
    lora: LoRAConfig | None = None
    profiles: dict[str, OptimizationProfile] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_option_names(cls, data: Any) -> Any:
        data = rename_deprecated_options(data)
        profiles = value_at(data, "profiles")
        if not isinstance(profiles, Mapping):
            return data
        where = "optimization.profiles"
        renamed = {k: rename_deprecated_options(v, f"{where}.{k}") for k, v in profiles.items()}
        return {**data, "profiles": renamed}

    @model_validator(mode="before")
    @classmethod
    def _expand_precision_preset(cls, data: Any) -> Any:
        preset = value_at(data, "precision", "preset")
        if preset not in PRECISION_PRESETS:
            return data  # None, or a name the field's own validation rejects
        return _deep_merge(PRECISION_PRESETS[preset]["optimization"], data)

    def resolve(self, profile: str | None = None) -> OptimizationConfig:
        """General settings for ``None``, else the profile merged over them.

        >>> opt = OptimizationConfig(profiles={"frozen": {"memory": {"activation_offload": True}}})
        >>> opt.resolve("frozen").memory.activation_offload, opt.resolve(None) is opt
        (True, True)
        """
        if profile is None:
            return self
        if profile not in self.profiles:
            available = ", ".join(repr(p) for p in self.profiles) or "none defined"
            raise ValueError(
                f"Unknown optimization profile {profile!r}; available profiles: {available}"
            )
        # Only what was written merges, so the result still knows which fields were set.
        base = self.model_dump(exclude_unset=True)
        base.pop("profiles", None)
        merged = _deep_merge(base, self.profiles[profile].model_dump(exclude_unset=True))
        try:
            return type(self).model_validate(merged)
        except ConfigError as exc:
            raise exc.with_prefix("optimization", "profiles", profile) from None

    @field_validator("experimental")
    @classmethod
    def _experimental_needs(cls, value: ExperimentalConfig, info: Any) -> Any:
        compile_cfg, memory = info.data.get("compile"), info.data.get("memory")
        if value.persistent_rows is not None and compile_cfg and not compile_cfg.enabled:
            raise ValueError(
                "persistent_rows changes the kernels that compile generates, and compile is off; "
                "set optimization.compile.enabled: true, or leave persistent_rows unset."
            )
        if value.fused_gelu_mlp and memory and memory.mlp_chunk_tokens is not None:
            raise ValueError(
                "fused_gelu_mlp and optimization.memory.mlp_chunk_tokens both replace the GELU "
                "MLPs' forward; keep mlp_chunk_tokens for memory, or fused_gelu_mlp for speed."
            )
        return value

    @model_validator(mode="after")
    def _profiles_resolve(self) -> OptimizationConfig:
        # A profile is partial, so rules across fields (experimental.persistent_rows needs
        # compile.enabled) can be checked only once it is merged over the general settings.
        # Merge each one now, so that a broken profile fails at load, not when a model uses it.
        for name in self.profiles:
            try:
                self.resolve(name)
            except ConfigError as exc:
                raise ValueError("; ".join(f"{p}: {m}" for p, m in exc.problems)) from None
        return self


OptimizationProfile = profile_model(OptimizationConfig)
OptimizationConfig.model_rebuild()
