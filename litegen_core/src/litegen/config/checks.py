"""Checks of a whole config that no single field can make: top-level typos, ignored options.

- A top-level key that LiteGen does not define is kept as the user's own field, unless it is a
  near miss of a defined one (``max_step`` for ``max_steps``): that is an error, since the run
  would otherwise silently use the default.
- An option that only some strategies read (``litegen.config.strategies.STRATEGY_OPTIONS``),
  set away from its default while the chosen strategy ignores it, is a warning naming both.
- ``activation_checkpoint.enabled: true`` with ``selective_ratio: 1.0`` (the default, meaning
  no block) is a warning naming the field and the fix.
- Two settings that do not work together (:data:`UNSUPPORTED`, the one table of such rules)
  are an error naming both fields and the fix, so ``inspect-config`` and ``launch`` refuse the
  config before any rank starts.

Like the rest of :mod:`litegen.config`, this module never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from litegen.config.strategies import FSDP2_OPTIONS, STRATEGIES, STRATEGY_OPTIONS, names_where


class IgnoredOptionWarning(UserWarning):
    """An option is set that the chosen parallel strategy never reads."""


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_")


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and adjacent swaps turning ``a`` into ``b``.

    >>> edit_distance("max_step", "max_steps"), edit_distance("init_form", "init_from")
    (1, 1)
    """
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, prev2[j - 2] + 1)
            row.append(cost)
        prev2, prev = prev, row
    return prev[-1]


def near_miss(key: str, fields: Iterable[str]) -> str | None:
    """The defined field ``key`` is most likely a typo of, or None.

    Close means: the same name up to case and ``-``/``_``; otherwise one edit for names of up
    to 6 letters and two for longer ones. Names of up to 3 letters (``lr``, ``ema``) only
    match up to case, so short fields of the user's own stay free.

    >>> near_miss("max_step", ["max_steps", "lr"]), near_miss("lrs", ["lr"]), near_miss("LR", ["lr"])
    ('max_steps', None, 'lr')
    """
    best: tuple[int, str] | None = None
    for field in fields:
        allowed = 0 if len(field) <= 3 else 1 if len(field) <= 6 else 2
        distance = edit_distance(_normalized(key), _normalized(field))
        if distance <= allowed and (best is None or distance < best[0]):
            best = (distance, field)
    return best[1] if best else None


def typo_problems(data: Any, fields: Iterable[str]) -> list[tuple[str, str]]:
    """``(key, message)`` for every top-level key of ``data`` that is a near miss of a field.

    >>> typo_problems({"max_step": 4, "my_model": {}}, ["max_steps"])[0][1][:38]
    "unknown field, did you mean 'max_steps"
    """
    if not isinstance(data, Mapping):
        return []
    fields = list(fields)
    problems = []
    for key in data:
        if not isinstance(key, str) or key in fields:
            continue
        close = near_miss(key, fields)
        if close is not None:
            problems.append(
                (
                    key,
                    f"unknown field, did you mean '{close}'? Your own top-level fields are "
                    f"kept, but one this close to a LiteGen field is taken for a typo; "
                    f"rename it if it is yours.",
                )
            )
    return problems


# --------------------------------------------------------------------------- ignored options


def _plain(value: Any) -> Any:
    to_dict = getattr(value, "to_dict", None)
    return to_dict() if callable(to_dict) else value


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    value = _plain(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, child in value.items():
            out.update(_leaves(child, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def _walk(section: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        section = getattr(section, part)
    return section


def _changed(section: Any, default: Any, dotted: str, prefix: str) -> dict[str, Any]:
    """Leaves under ``dotted`` whose value differs from the default section's."""
    mine = _leaves(_walk(section, dotted), f"{prefix}.{dotted}")
    base = _leaves(_walk(default, dotted), f"{prefix}.{dotted}")
    return {path: value for path, value in mine.items() if base.get(path) != value}


def _describe(path: str, value: Any, strategies: list[str], readers: tuple[str, ...]) -> str:
    if len(strategies) == 1:
        who = f"strategy '{strategies[0]}' ignores it"
    else:
        who = f"none of the strategies in use ({', '.join(strategies)}) reads it"
    return (
        f"{path} is set ({value!r}), but {who}; only {', '.join(readers)} read it. "
        "Remove it, or choose a strategy that reads it."
    )


def ignored_options(config: Any) -> list[str]:
    """One line per set option that no strategy of ``config`` reads, or that does nothing
    (activation checkpointing of no block); see the module docs.

    An option of the general ``optimization`` section counts as read when the general strategy
    or any profile's strategy reads it (profiles inherit it); an option set in a profile, when
    that profile's strategy reads it.

    >>> from litegen.config import MainConfig
    >>> cfg = MainConfig(optimization={"precision": {"fsdp_mixed": {"param_dtype": "bf16"}}})
    >>> ignored_options(cfg)[0][:61]
    "optimization.precision.fsdp_mixed.param_dtype is set ('bf16')"
    """
    optimization = config.optimization
    default = type(optimization)()
    profiles = {name: optimization.resolve(name) for name in optimization.profiles}
    in_use = [optimization.parallel.strategy]
    in_use += [p.parallel.strategy for p in profiles.values() if p.parallel.strategy not in in_use]
    lines = []
    for option, readers in STRATEGY_OPTIONS.items():
        section_name, _, dotted = option.partition(".")
        if section_name == "optimization":
            if any(strategy in readers for strategy in in_use):
                continue
            changed = _changed(optimization, default, dotted, "optimization")
            strategies = in_use
        else:  # a section outside optimization: the general strategy decides
            if optimization.parallel.strategy in readers:
                continue
            top = getattr(config, section_name)
            changed = _changed(top, type(top)(), dotted, section_name)
            strategies = [optimization.parallel.strategy]
        lines += [_describe(path, value, strategies, readers) for path, value in changed.items()]
    lines += inert_checkpointing(optimization, profiles)
    for name, profile in optimization.profiles.items():
        strategy = profiles[name].parallel.strategy
        written = _leaves(profile.to_dict(), f"optimization.profiles.{name}")
        for option, readers in STRATEGY_OPTIONS.items():
            section_name, _, dotted = option.partition(".")
            if section_name != "optimization" or strategy in readers:
                continue
            prefix = f"optimization.profiles.{name}.{dotted}"
            lines += [
                _describe(path, value, [strategy], readers)
                for path, value in written.items()
                if path == prefix or path.startswith(prefix + ".")
            ]
    return lines


def inert_checkpointing(optimization: Any, profiles: Mapping[str, Any]) -> list[str]:
    """A line for the general section and each resolved profile whose activation
    checkpointing is enabled but checkpoints no block (``selective_ratio: 1.0``)."""
    sections = {"optimization": optimization}
    sections.update({f"optimization.profiles.{n}": p for n, p in profiles.items()})
    lines = []
    general = optimization.memory.activation_checkpoint
    for where, section in sections.items():
        ac = section.memory.activation_checkpoint
        if where != "optimization" and ac == general:
            continue  # inherited: the general section's line covers it
        line = ac.checkpoints_nothing(f"{where}.memory.activation_checkpoint")
        if line is not None:
            lines.append(line)
    return lines


# --------------------------------------------------------------------------- combinations


@dataclass(frozen=True)
class Unsupported:
    """Two settings that do not work together. ``fields`` are dotted paths from the config's
    root; those under ``optimization.`` are checked in every profile too. ``applies`` gets the
    config and one resolved ``optimization`` section."""

    fields: tuple[str, str]
    applies: Callable[[Any, Any], bool]
    fix: str


def _ac(opt: Any) -> Any:
    return opt.memory.activation_checkpoint


def _row(opt: Any) -> Any:
    return STRATEGIES[opt.parallel.strategy]


_FSDP2_READERS = " or ".join(STRATEGY_OPTIONS[FSDP2_OPTIONS])
_REPLICATED = " or ".join(names_where(lambda row: not row.shards))  # whole weights everywhere


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported(
        ("optimization.parallel.sp_size", "optimization.parallel.strategy"),
        lambda cfg, opt: opt.parallel.sp_size > 1 and not _row(opt).sequence_parallel,
        f"{' and '.join(names_where(lambda row: not row.sequence_parallel))} has no "
        "sequence-parallel layout; use one of the strategies that have one "
        f"({', '.join(names_where(lambda row: row.sequence_parallel))}), or sp_size: 1",
    ),
    Unsupported(
        ("optimization.parallel.cp_size", "optimization.parallel.strategy"),
        lambda cfg, opt: opt.parallel.cp_size > 1 and not _row(opt).sequence_parallel,
        f"{' and '.join(names_where(lambda row: not row.sequence_parallel))} has no "
        "sequence-parallel layout for ring attention; use one of the strategies that have one "
        f"({', '.join(names_where(lambda row: row.sequence_parallel))}), or cp_size: 1",
    ),
    Unsupported(
        ("optimization.memory.activation_checkpoint.policy", "optimization.compile.enabled"),
        lambda cfg, opt: (
            _ac(opt).enabled and _ac(opt).policy == "memory_budget" and not opt.compile.enabled
        ),
        "policy memory_budget is carried out by torch.compile's partitioner; set "
        "compile.enabled: true, or use policy ops (or block) without compile",
    ),
    Unsupported(
        ("optimization.memory.activation_checkpoint.selective_ratio", "runtime.device"),
        lambda cfg, opt: (
            _ac(opt).enabled
            and _ac(opt).selective_ratio == "auto"
            and _ac(opt).memory_budget_gib is None
            and cfg.runtime.device == "cpu"
        ),
        "selective_ratio auto takes a fraction of the device's memory, and a cpu has none to "
        "measure; set activation_checkpoint.memory_budget_gib",
    ),
    Unsupported(
        ("optimization.memory.block_swap", "optimization.lora"),
        lambda cfg, opt: opt.memory.block_swap is not None and opt.lora is None,
        "block swap streams frozen base weights, and without LoRA every weight trains; set "
        "optimization.lora, or for full fine-tuning use strategy fsdp2 with "
        "parallel.fsdp2.cpu_offload: true",
    ),
    Unsupported(
        ("optimization.memory.block_swap", "optimization.parallel.strategy"),
        lambda cfg, opt: opt.memory.block_swap is not None and bool(_row(opt).shards),
        "block swap moves whole frozen weights, which the sharding strategies split and manage "
        f"themselves; use strategy {_REPLICATED} (one rank or more), or "
        f"parallel.fsdp2.cpu_offload: true under {_FSDP2_READERS}",
    ),
    Unsupported(
        ("optimization.memory.block_swap", "optimization.memory.activation_offload"),
        lambda cfg, opt: opt.memory.block_swap is not None and opt.memory.activation_offload,
        "both take over what a block saves for backward through saved-tensor hooks; turn "
        "activation_offload off (activation checkpointing works with block swap), or block_swap",
    ),
    Unsupported(
        ("optimization.memory.block_swap", "optimization.compile.enabled"),
        lambda cfg, opt: opt.memory.block_swap is not None and opt.compile.enabled is True,
        "block swap replaces a block's weights around each call, which compiled blocks would "
        "guard on and recompile for; set compile.enabled: false, or remove block_swap",
    ),
    Unsupported(
        ("optimization.lora.fp8_base", "optimization.parallel.strategy"),
        lambda cfg, opt: (
            opt.lora is not None and opt.lora.fp8_base is not None and bool(_row(opt).shards)
        ),
        "fp8_base replaces whole frozen Linear weights, which the sharding strategies split and "
        f"manage themselves; use strategy {_REPLICATED} (one rank or more), or fp8_base: null",
    ),
    Unsupported(
        ("optimization.parallel.fsdp2.cpu_offload", "optimization.optimizer.backend"),
        lambda cfg, opt: (
            opt.parallel.fsdp2.cpu_offload
            and opt.optimizer.backend == "fused"
            and FSDP2_OPTIONS in _row(opt).options
        ),
        "with cpu_offload the optimizer steps parameters in host memory, and the fused backend "
        "needs them on CUDA; set optimizer.backend: foreach, or cpu_offload: false",
    ),
    Unsupported(
        ("trainer.export_diffusers", "optimization.lora"),
        lambda cfg, opt: cfg.trainer.export_diffusers and opt.lora is not None,
        "export_diffusers writes whole models, and a LoRA run's adapter files are already in "
        "diffusers' layout; turn export_diffusers off (gen.save_lora_peft writes a peft folder)",
    ),
)


def _value(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return getattr(root, "value", root)  # an Enum's value


def combination_problems(config: Any) -> list[tuple[str, str]]:
    """``(field, message)`` for each :data:`UNSUPPORTED` pair a config sets, in the general
    ``optimization`` section or a profile (profiles inheriting the general problem are not
    repeated).

    >>> from litegen.config import MainConfig
    >>> MainConfig(optimization={"parallel": {"sp_size": 2, "strategy": "fsdp1"}})
    Traceback (most recent call last):
    litegen.config.base.ConfigError: ... field 'optimization.parallel.sp_size': 2 does not work with
    optimization.parallel.strategy ('fsdp1'): fsdp1 has no sequence-parallel layout; ...
    """
    optimization = config.optimization
    sections = {"optimization": optimization}
    sections.update(
        {f"optimization.profiles.{n}": optimization.resolve(n) for n in optimization.profiles}
    )
    problems: list[tuple[str, str]] = []
    for rule in UNSUPPORTED:
        general = None
        for where, opt in sections.items():
            if not rule.applies(config, opt):
                continue
            paths = [
                f"{where}{f.removeprefix('optimization')}" if f.startswith("optimization.") else f
                for f in rule.fields
            ]
            values = [
                _value(opt, f.removeprefix("optimization."))
                if f.startswith("optimization.")
                else _value(config, f)
                for f in rule.fields
            ]
            if general == values:
                continue  # a profile inheriting the general section's problem
            general = general or (values if where == "optimization" else None)
            shown = ["set" if isinstance(v, BaseModel) else repr(v) for v in values]
            problems.append(
                (paths[0], f"{shown[0]} does not work with {paths[1]} ({shown[1]}): {rule.fix}.")
            )
    return problems
