"""Building blocks of :mod:`litegen.utils.config`: the ``Config`` base class, the typed
sections of ``MainConfig`` and the error formatting shared by every constructor.

Import the public names from :mod:`litegen.utils.config`; this module only exists to keep
each file readable. It must never import torch (the CLI imports it for fast validation).
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Mapping
from enum import Enum
from pathlib import PurePath
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

Dtype = Literal["fp32", "bf16", "fp16"]
"""Names accepted by every dtype field."""

_NoneType = type(None)


# --------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """Invalid configuration; ``problems`` holds ``(field path, message)`` pairs.

    >>> str(ConfigError([("ema.decay", "Input should be less than or equal to 1")])).splitlines()[1]
    "  - field 'ema.decay': Input should be less than or equal to 1"
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = list(problems)
        lines = [f"  - field '{path}': {msg}" for path, msg in self.problems]
        super().__init__(
            "Error to load config, found the following problems:\n"
            + "\n".join(lines)
            + "\nPlease check your configuration."
        )

    def with_prefix(self, *prefix: str) -> ConfigError:
        """Return the same problems with ``prefix`` prepended to every field path."""
        head = ".".join(prefix)
        return ConfigError([(f"{head}.{p}" if p else head, m) for p, m in self.problems])

    @classmethod
    def from_validation_error(cls, model: type[BaseModel], exc: ValidationError) -> ConfigError:
        """Convert pydantic's errors for ``model`` into one ``ConfigError``.

        Union members (``bool | int``) produce one error each in pydantic; they are merged
        into a single line for the field. Unknown keys get a "did you mean" hint.
        """
        merged: dict[str, list[str]] = {}
        for err in exc.errors():
            loc, owner = _locate(model, tuple(err["loc"]))
            msg = str(err["msg"]).removeprefix("Value error, ")
            if err["type"] == "extra_forbidden" and owner is not None and loc:
                close = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1)
                if close:
                    msg += f", did you mean '{close[0]}'?"
            path = ".".join(str(p) for p in loc) or "<root>"
            msgs = merged.setdefault(path, [])
            if msg not in msgs:
                msgs.append(msg)
        return cls([(path, "; or ".join(msgs)) for path, msgs in merged.items()])


def _unwrap(ann: Any) -> Any:
    """Strip ``Annotated`` and ``Optional`` from a type annotation."""
    origin = get_origin(ann)
    if origin is Annotated:
        return _unwrap(get_args(ann)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not _NoneType]
        if len(args) == 1:
            return _unwrap(args[0])
    return ann


def _locate(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """Trim pydantic's ``loc`` to the user-facing field path.

    Returns the path and, when the path ends at a key a model does not declare, that model
    (for the did-you-mean hint).
    """
    ann: Any = model
    for i, part in enumerate(loc):
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return loc[: i + 1], ann
            ann = field.annotation
        elif get_origin(ann) in (dict, Mapping, list, tuple, set, frozenset):
            args = get_args(ann)
            ann = args[-1] if args else Any
        elif get_origin(ann) in (Union, types.UnionType):
            return loc[:i], None  # the rest names the union member that failed
        else:
            return loc, None
    return loc, None


# --------------------------------------------------------------------------- Config base


def _to_config_value(value: Any) -> Any:
    """Turn dicts with string keys into ``Config`` (recursively, also inside lists)."""
    if isinstance(value, BaseModel):
        return value
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return Config.model_validate(dict(value))
        return value  # non-string keys (e.g. {1: 0.1}) stay a plain dict
    if isinstance(value, list):
        return [_to_config_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_config_value(v) for v in value)
    return value


def _to_plain(value: Any) -> Any:
    """Turn configs back into plain dicts/lists of YAML-safe scalars."""
    if isinstance(value, Config):
        return value.to_dict()
    if isinstance(value, BaseModel):
        return _to_plain(value.model_dump())
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_to_plain(v) for v in value]
    if isinstance(value, Enum):
        return _to_plain(value.value)
    if isinstance(value, PurePath):
        return str(value)
    return value


class Config(BaseModel):
    """Attribute-style config node that keeps unknown fields.

    Nested dicts (also inside lists) become ``Config`` objects; dicts with non-string keys
    stay plain dicts.

    >>> cfg = Config(model={"depth": 28}, schedule={1: 0.1})
    >>> cfg.model.depth, cfg["model"]["depth"], cfg.get("missing", 3), "model" in cfg
    (28, 28, 3, True)
    >>> cfg.schedule
    {1: 0.1}
    """

    model_config = ConfigDict(extra="allow")

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError.from_validation_error(type(self), exc) from None

    # Same validation as BaseModel.__init__, only the error type differs: tell pydantic it
    # need not call this __init__ for nested models (their errors must stay pydantic's so
    # that the outermost constructor can report every field with its full path).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:
        """Like pydantic's ``model_validate``, but raises ``ConfigError`` on bad input."""
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise ConfigError.from_validation_error(cls, exc) from None

    @model_validator(mode="after")
    def _convert_extras(self) -> Config:
        extra = self.__pydantic_extra__
        if extra:
            for key, value in extra.items():
                extra[key] = _to_config_value(value)
        return self

    def keys(self) -> list[str]:
        """Declared field names followed by the extra ones: ``list(cfg.keys())``."""
        return [*type(self).model_fields, *(self.__pydantic_extra__ or {})]

    def items(self) -> list[tuple[str, Any]]:
        """``(key, value)`` pairs, as for a dict: ``dict(cfg.items())``."""
        return [(k, self[k]) for k in self.keys()]

    def get(self, key: str, default: Any = None) -> Any:
        """Value of ``key``, or ``default`` when absent: ``cfg.get("lr", 1e-4)``."""
        try:
            return self[key]
        except KeyError:
            return default

    def __getitem__(self, key: str) -> Any:
        if key in type(self).model_fields:
            return getattr(self, key)
        extra = self.__pydantic_extra__ or {}
        if key in extra:
            return extra[key]
        raise KeyError(key)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def __contains__(self, key: object) -> bool:
        return key in type(self).model_fields or key in (self.__pydantic_extra__ or {})

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts/lists (YAML/JSON-safe): ``yaml.safe_dump(cfg.to_dict())``."""
        out = {name: _to_plain(getattr(self, name)) for name in type(self).model_fields}
        out.update({k: _to_plain(v) for k, v in (self.__pydantic_extra__ or {}).items()})
        return out


class Section(Config):
    """Base of LiteGen's own sections: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")


class ProfileSection(Section):
    """Base of the partial sections used by ``optimization.profiles``.

    Every field is optional; only the fields a profile sets are exported and merged.
    """

    partial: ClassVar[bool] = True

    def to_dict(self) -> dict[str, Any]:
        """Only the fields the profile sets: ``{"memory": {"activation_offload": True}}``."""
        names = [n for n in type(self).model_fields if n in self.model_fields_set]
        return {name: _to_plain(getattr(self, name)) for name in names}


# --------------------------------------------------------------------------- runtime


class DistributedConfig(Section):
    """Process-group settings (``runtime.distributed``)."""

    backend: str | None = Field(None, description="None: nccl on CUDA, gloo on CPU")
    dist_url: str = "env://"
    dist_timeout: int = Field(1800, ge=1, description="seconds")


class RuntimeConfig(Section):
    """Device and distributed environment (``runtime``)."""

    device: Literal["cuda", "cpu", "npu"] | None = Field(
        None, description="None: cuda when available, otherwise cpu"
    )
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)


# --------------------------------------------------------------------------- optimization


class Zero1Config(Section):
    """Options of the ``zero1`` strategy (``optimization.parallel.zero1``)."""

    bucket_size_mb: int = Field(64, ge=1)
    parameter_sync: Literal["bucketed", "native", "native_bucket_view"] = "bucketed"
    overlap_comm: bool = True
    release_grad_buffer: bool = True
    normalize_parameter_layout: bool = False


class FSDP2Config(Section):
    """Options of the ``fsdp2``/``hsdp`` strategies (``optimization.parallel.fsdp2``)."""

    wrap_strategy: Literal["manual", "repeated", "size_based", "class_based"] = "repeated"
    wrap_paths: list[str] = Field(default_factory=list)
    wrap_class_names: list[str] = Field(default_factory=list)
    min_num_params: int = Field(1, ge=1)
    exclude_paths: list[str] = Field(default_factory=list)
    reshard_after_forward: bool | int | None = None
    root_reshard_after_forward: bool | int | None = None
    last_unit_reshard_after_forward: bool | int | None = None
    allow_empty_param_unit_sharding: bool = False


class ParallelConfig(Section):
    """Parallel strategy and degrees (``optimization.parallel``)."""

    strategy: Literal["ddp", "zero1", "zero2", "hsdp", "fsdp1", "fsdp2"] = "ddp"
    zero1: Zero1Config = Field(default_factory=Zero1Config)
    fsdp2: FSDP2Config = Field(default_factory=FSDP2Config)
    tp_size: int = Field(1, ge=1)
    sp_size: int = Field(1, ge=1)
    cp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)


class FSDP2MixedConfig(Section):
    """FSDP2 mixed-precision policy (``optimization.precision.fsdp2_mixed``)."""

    param_dtype: Dtype | None = None
    reduce_dtype: Dtype | None = None
    output_dtype: Dtype | None = None
    cast_forward_inputs: bool = True


class PrecisionConfig(Section):
    """Model dtype cast and mixed precision (``optimization.precision``)."""

    cast_model: Dtype | None = None
    cast_exclude_paths: list[str] = Field(default_factory=list)
    fsdp2_mixed: FSDP2MixedConfig = Field(default_factory=FSDP2MixedConfig)
    allow_tf32: bool = True


class OptimizerConfig(Section):
    """Optimizer wrapping options (``optimization.optimizer``)."""

    fp32_master_weights: bool = False
    backend: Literal["single_tensor", "foreach", "fused"] = "single_tensor"


class CompileConfig(Section):
    """Regional ``torch.compile`` of the repeated blocks (``optimization.compile``).

    ``dynamic: null`` bounds recompiles for variable resolutions (see docs/performance.md).
    """

    enabled: bool = False
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "default"
    )
    dynamic: bool | None = False


class ActivationCheckpointConfig(Section):
    """Activation checkpointing (``optimization.memory.activation_checkpoint``)."""

    enabled: bool = False
    selective_ratio: float = Field(1.0, ge=0.0, le=1.0, description="share left uncheckpointed")
    target_paths: list[str] = Field(default_factory=list)
    policy: Literal["block", "ops"] = "block"
    """``block`` recomputes whole blocks; ``ops`` keeps matmul/attention outputs, recomputes the rest."""


class MemoryConfig(Section):
    """Memory savers (``optimization.memory``)."""

    activation_checkpoint: ActivationCheckpointConfig = Field(
        default_factory=ActivationCheckpointConfig
    )
    activation_offload: bool = False


class KernelsConfig(Section):
    """Kernel replacements (``optimization.kernels``)."""

    fused_layernorm: bool = False
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math", "flash_attn"] = "auto"
    """Scaled-dot-product-attention kernel for the run (see ``litegen.kernels.attention``)."""


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
    profiles: dict[str, OptimizationProfile] = Field(default_factory=dict)

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


OptimizationProfile = profile_model(OptimizationConfig)
OptimizationConfig.model_rebuild()


# --------------------------------------------------------------------------- ema, trainer


class EMAConfig(Section):
    """Exponential moving average of the trainable model (``ema``)."""

    enable: bool = False
    sharded: bool = True
    decay: float = Field(0.9999, ge=0.0, le=1.0)
    resume_from: str | None = None


class TrainerConfig(Section):
    """Training-loop settings read by LiteGen's trainer (``trainer``)."""

    grad_accum_steps: int = Field(1, ge=1)
    max_grad_norm: float | None = Field(None, gt=0)
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="0: no periodic checkpoint")
    save_final: bool = True
    keep_last: int | None = Field(None, ge=1, description="None: keep every checkpoint")
    async_checkpoint: bool = Field(
        False, description="write run checkpoints in the background (dcp.async_save)"
    )
    resume_run: str | None = Field(
        None, description="run checkpoint (step_<N> folder or checkpoint_dir) to continue from"
    )
    on_nan: Literal["abort", "skip"] = "abort"
    autocast: Literal["bf16", "fp16"] | None = None
    peak_tflops: float | None = Field(
        None, gt=0, description="peak FLOP/s per GPU for MFU; None: the known-GPU table"
    )
    tokens_per_sample: int | None = Field(
        None, ge=1, description="for tokens/s; None: the model's tokens_per_sample, if any"
    )
