"""The base of :mod:`litegen.config`: the ``Config`` node, the ``Section`` bases of
LiteGen's typed sections, and the error formatting shared by every constructor.

Import the public names from :mod:`litegen.config`. It must never import torch (the CLI
imports it for fast validation).
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from enum import Enum
from pathlib import PurePath
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

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
        found = type(self).whole_config_problems(data)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = found + ConfigError.from_validation_error(type(self), exc).problems
            raise ConfigError(problems) from None
        found += self.combination_problems()
        if found:
            raise ConfigError(found)

    # Same validation as BaseModel.__init__, only the error type differs: tell pydantic it
    # need not call this __init__ for nested models (their errors must stay pydantic's so
    # that the outermost constructor can report every field with its full path).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:
        """Like pydantic's ``model_validate``, but raises ``ConfigError`` on bad input."""
        found = cls.whole_config_problems(obj)
        try:
            result = super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            problems = found + ConfigError.from_validation_error(cls, exc).problems
            raise ConfigError(problems) from None
        found += result.combination_problems()
        if found:
            raise ConfigError(found)
        return result

    @classmethod
    def whole_config_problems(cls, data: Any) -> list[tuple[str, str]]:
        """``(path, message)`` problems of the raw input that no field validator sees (none
        here); listed with pydantic's, so every problem is reported at once."""
        return []

    def combination_problems(self) -> list[tuple[str, str]]:
        """``(path, message)`` problems of valid fields that do not work together (none here);
        checked once every field is valid, and listed with the raw input's problems."""
        return []

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


class DeprecatedFieldWarning(FutureWarning):
    """A field read under the spelling of an earlier version; the message names the new one."""


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
