"""Recipes: one YAML file = a `launch:` section + the MainConfig fields + the user's fields.

Loading never imports torch, so `litegen inspect-config` and `--help` stay fast. All checks
run here, before any process is spawned, and every problem found is reported at once in
the same format as ``MainConfig`` uses.
"""

from __future__ import annotations

import copy
import difflib
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from litegen.config import MainConfig, YamlLoader
from litegen.config.checks import IgnoredOptionWarning, ignored_options
from litegen.config.finetune import DeprecatedFieldWarning
from litegen.config.strategies import global_batch_problems, job_shape_problems
from litegen_cli.entry_check import entry_problems
from litegen_cli.slurm import apply_slurm_env

HEADER = "Error to load config, found the following problems:"
FOOTER = "Please check your configuration."


class RecipeError(ValueError):
    """A recipe that cannot be used; ``problems`` holds one line per offending field.

    ``str(err)`` is the config module's format, so both read the same in a terminal.
    """

    def __init__(self, problems: list[str], *, title: str = HEADER, hint: str = FOOTER):
        self.problems = list(problems)
        self.title = title
        self.hint = hint
        super().__init__(format_problems(self.problems, title=title, hint=hint))


def format_problems(problems: list[str], *, title: str = HEADER, hint: str = FOOTER) -> str:
    """Render problems as the config module does.

    >>> print(format_problems(["field 'launch.nnodes': Input should be greater than or equal to 1"]))
    Error to load config, found the following problems:
      - field 'launch.nnodes': Input should be greater than or equal to 1
    Please check your configuration.
    """
    lines = [title, *(f"  - {p}" for p in problems)]
    if hint:
        lines.append(hint)
    return "\n".join(lines)


class LaunchSpec(BaseModel):
    """The `launch:` section: how torchrun starts the ranks of one node."""

    model_config = ConfigDict(extra="forbid")

    entry: str = Field(description="module name (pkg.mod) or .py path relative to the recipe")
    nproc_per_node: int = Field(1, ge=1, description="ranks started on this node")
    nnodes: int = Field(1, ge=1, description="number of nodes in the job")
    node_rank: int = Field(0, ge=0, description="rank of this node, 0..nnodes-1")
    rdzv_endpoint: str = Field("localhost:29500", description="host:port of the rendezvous")
    rdzv_id: str = Field("litegen", description="job id shared by all nodes")
    rdzv_backend: Literal["c10d", "static"] = "c10d"
    max_restarts: int = Field(0, ge=0, description="restarts of the worker group on failure")
    monitor_interval: float = Field(0.1, gt=0, description="seconds between worker checks")
    # Filled in by load_recipe: the folder of the ORIGINAL recipe, so that a resolved copy
    # written into the results dir still resolves relative entry paths.
    recipe_dir: str | None = None


@dataclass
class Recipe:
    """A loaded, validated recipe.

    Example::

        recipe = load_recipe(Path("recipes/digits_dit.yaml"), ["max_steps=10"])
        recipe.launch.nproc_per_node, recipe.config.max_steps
    """

    path: Path
    launch: LaunchSpec
    config: MainConfig
    data: dict[str, Any]  # the raw YAML with overrides applied (launch section included)
    warnings: list[str] = field(default_factory=list)  # options the strategy ignores

    @property
    def base_dir(self) -> Path:
        """Folder that relative entry paths are resolved against."""
        return Path(self.launch.recipe_dir) if self.launch.recipe_dir else self.path.parent

    def resolved_dict(self) -> dict[str, Any]:
        """`launch:` + the validated config, ready to be written as the resolved recipe.

        A ``.py`` entry is written as an absolute path, like the config's paths.
        """
        launch = self.launch.model_dump()
        entry = Path(launch["entry"]).expanduser()
        if launch["entry"].endswith(".py") and not entry.is_absolute():
            launch["entry"] = str((self.base_dir / entry).absolute())
        return {"launch": launch, **self.config.to_dict()}


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and YAML-parsed value.

    >>> parse_override("optimization.parallel.strategy=fsdp1")
    (['optimization', 'parallel', 'strategy'], 'fsdp1')
    >>> parse_override("max_steps=3")
    (['max_steps'], 3)
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ValueError(f"override '{text}' has no '=': write it as key.path=value")
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ValueError(f"override '{text}' has an empty key: write it as key.path=value")
    try:
        value = yaml.load(raw, Loader=YamlLoader)  # safe_load + `1e-4` as float
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
        raise ValueError(f"override '{text}': value is not valid YAML ({first})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply dotted overrides to ``data`` in place; return one problem line per bad one.

    >>> d = {"trainer": {"log_every": 10}}
    >>> apply_overrides(d, ["trainer.log_every=1", "launch.nnodes=2"])
    []
    >>> d
    {'trainer': {'log_every': 1}, 'launch': {'nnodes': 2}}
    """
    problems: list[str] = []
    for text in overrides:
        try:
            parts, value = parse_override(text)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                problems.append(
                    f"override '{text}': '{where}' is a {type(child).__name__}, not a section"
                )
                break
            node = child
        else:
            node[parts[-1]] = value
    return problems


def _pydantic_problems(exc: ValidationError, prefix: str) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), list(LaunchSpec.model_fields))
            if close:
                msg += f", did you mean '{close[0]}'?"
        problems.append(f"field '{loc}': {msg}")
    return problems


def _config_problems(exc: ValueError) -> list[str]:
    """MainConfig's problems as lines; any other ValueError is kept whole."""
    pairs = getattr(exc, "problems", None)  # ConfigError: [(field path, message), ...]
    if pairs:
        return [f"field '{path}': {msg}" for path, msg in pairs]
    lines = [ln[4:] for ln in str(exc).splitlines() if ln.startswith("  - ")]
    return lines or [str(exc)]


def layout_problems(*, world: int, sp: int, cp: int, accum: int, global_batch: int) -> list[str]:
    """The rank layout and batch arithmetic's problems, one line each.

    >>> layout_problems(world=2, sp=1, cp=1, accum=1, global_batch=3)
    ["field 'global_batch_size': 3 is not divisible by data-parallel size 2 * trainer.grad_accum_steps 1 = 2; use a multiple of 2"]
    """
    # The rules are the core's (the strategy's own: plan.runtime_refusals).
    shape = job_shape_problems(world_size=world, nnodes=1, sp_size=sp, cp_size=cp)
    batch = global_batch_problems(
        global_batch_size=global_batch, dp_size=max(world // (sp * cp), 1), grad_accum_steps=accum
    )
    return [str(problem) for problem in [*shape, *batch]]


def _raw_layout_problems(data: dict[str, Any], launch: dict[str, Any]) -> list[str]:
    """:func:`layout_problems` of a recipe that failed validation, from its raw values, so
    that one round lists them with the field errors; a value that is itself invalid (already
    reported) skips the check."""

    def read(section: Any, path: str, default: Any) -> Any:
        for key in path.split("."):
            section = section.get(key) if isinstance(section, dict) else None
        return default if section is None else section

    numbers = {
        "nproc": read(launch, "nproc_per_node", 1),
        "nnodes": read(launch, "nnodes", 1),
        "sp": read(data, "optimization.parallel.sp_size", 1),
        "cp": read(data, "optimization.parallel.cp_size", 1),
        "accum": read(data, "trainer.grad_accum_steps", 1),
        "global_batch": read(data, "global_batch_size", 1),
    }
    if not all(type(v) is int and v >= 1 for v in numbers.values()):
        return []
    numbers["world"] = numbers.pop("nproc") * numbers.pop("nnodes")
    return layout_problems(**numbers)


def read_recipe_file(path: Path) -> dict[str, Any]:
    """Read a recipe YAML into a dict; raise RecipeError naming the path and the fix."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise RecipeError(
            [f"recipe file '{path}' {what}"],
            title="Cannot read the recipe:",
            hint="Pass the path of a YAML recipe, e.g. `litegen launch recipes/digits_dit.yaml`.",
        )
    try:
        data = yaml.load(
            path.read_text(encoding="utf-8"), Loader=YamlLoader
        )  # as MainConfig.load_yaml reads files
    except yaml.YAMLError as exc:
        raise RecipeError(
            [f"recipe file '{path}' is not valid YAML: {exc}"],
            title="Cannot read the recipe:",
            hint="Fix the YAML syntax at the position shown above.",
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [f"recipe file '{path}' holds a {type(data).__name__}, not a mapping"],
            title="Cannot read the recipe:",
            hint="A recipe is a YAML mapping: a `launch:` section beside the config fields.",
        )
    return data


def load_recipe(
    path: Path | str, overrides: list[str] | None = None, env: Mapping[str, str] | None = None
) -> Recipe:
    """Load, override and validate a recipe; raise RecipeError listing every problem.

    ``env`` defaults to ``os.environ`` and is only read for SLURM variables.

    Example:
        >>> _ = Path("entry.py").write_text("def build(config): ...\\ndef train_step(batch): ...\\n")
        >>> _ = Path("recipe.yaml").write_text("launch: {entry: entry.py}\\nglobal_batch_size: 8\\n")
        >>> recipe = load_recipe("recipe.yaml", ["launch.nproc_per_node=2"])
        >>> recipe.launch.nproc_per_node
        2
    """
    path = Path(path).expanduser().absolute()
    return recipe_from_data(read_recipe_file(path), path, overrides, env)


def recipe_from_data(
    data: dict[str, Any],
    path: Path,
    overrides: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Recipe:
    """:func:`load_recipe` for a recipe already read into ``data`` (left unchanged).

    ``path`` (absolute) is where the recipe came from: relative entry paths resolve against
    its folder unless ``launch.recipe_dir`` says otherwise.
    """
    data = copy.deepcopy(data)  # the overrides and launch defaults below write into it
    problems = apply_overrides(data, list(overrides or []))

    raw_launch = data.get("launch", {})
    if raw_launch is None:
        raw_launch = {}
    if not isinstance(raw_launch, dict):
        problems.append("field 'launch': Input should be a valid dictionary")
        raw_launch = {}
    raw_launch = apply_slurm_env(raw_launch, os.environ if env is None else env)
    raw_launch.setdefault("recipe_dir", str(path.parent))

    spec: LaunchSpec | None = None
    try:
        spec = LaunchSpec.model_validate(raw_launch)
    except ValidationError as exc:
        problems.extend(_pydantic_problems(exc, "launch"))
    if spec is not None and spec.node_rank >= spec.nnodes:
        problems.append(
            f"field 'launch.node_rank': {spec.node_rank} must be below nnodes ({spec.nnodes})"
        )
    if spec is not None:
        problems += entry_problems(spec.entry, Path(spec.recipe_dir or path.parent))

    config: MainConfig | None = None
    deprecated: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore", IgnoredOptionWarning)  # returned as Recipe.warnings
            warnings.simplefilter("always", DeprecatedFieldWarning)  # so are these
            config = MainConfig.from_dict({k: v for k, v in data.items() if k != "launch"})
        deprecated = [str(w.message) for w in caught if w.category is DeprecatedFieldWarning]
    except ValueError as exc:
        problems.extend(_config_problems(exc))

    if problems or spec is None or config is None:
        # Checked on the validated recipe by run_shape.derive_run_shape otherwise.
        problems += [p for p in _raw_layout_problems(data, raw_launch) if p not in problems]
        raise RecipeError(problems)
    # Absolute paths: the ranks, and a later `litegen resume` from any folder, use the same files.
    config = config.with_absolute_paths()
    notes = [*deprecated, *ignored_options(config)]
    return Recipe(path=path, launch=spec, config=config, data=data, warnings=notes)
