"""`litegen resume --from CKPT_DIR`: start a run again from the config saved in its checkpoint.

The recipe is rebuilt from the checkpoint's ``config.yaml`` and ``launch.yaml`` (the entry
module and rank layout ``litegen launch`` used), the command's overrides are applied on top,
and ``trainer.resume_run`` is pointed at the checkpoint. The recipe is then validated and
launched exactly like ``litegen launch`` does. torch is imported only by :func:`resume_recipe`
(to read DCP's metadata of the checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from litegen.checkpoint.layout import CONFIG, LAUNCH, MANIFEST
from litegen.checkpoint.step_dirs import read_config_text, resolve_checkpoint
from litegen_cli.recipe import Recipe, RecipeError, recipe_from_data

_IGNORED = {"launch.recipe_dir"}  # bookkeeping that `litegen` fills in, not a user choice
# Fields a resume cannot change without breaking the run it continues, and why. Every other
# field is read by the run as it goes or when it builds its parts, so its new value applies
# (a model that no longer fits the checkpoint is refused by the ranks as they load it).
FIXED_AT_RESUME = {
    "global_batch_size": "the step is the data position (step x global_batch_size): another "
    "size would skip or repeat samples",
    "global_seed": "the current epoch's sample order depends on it, and the RNG states come "
    "from the checkpoint",
    "init_from": "the weights come from the run checkpoint",
    "resume_from": "the run checkpoint given with --from takes its place",
    "trainer.resume_run": "give the checkpoint with --from",
}
# Fields the checkpoint also holds a value of, and how the new one reaches the restored state.
APPLIED_TO_RESTORED = {
    "lr": "applied: the restored optimizer's and LR schedulers' rates are scaled by new/old",
    "weight_decay": "applied to the restored optimizer's param groups that had the old value",
}


def resume_recipe(
    checkpoint: Path, overrides: list[str], branch: Path | None = None
) -> tuple[Recipe, list[str]]:
    """The recipe that continues the run in ``checkpoint``, and the fields that changed.

    ``checkpoint`` is a ``step_<N>`` folder or a checkpoint_dir (its latest complete step).
    ``branch``: the run continues in that new folder (results and checkpoints) instead of the
    checkpoint's own.
    Raises RecipeError, naming the path and the problem, for a missing, partial or corrupt
    checkpoint; nothing is written.

    Example::

        recipe, changes = resume_recipe(Path("results/dit/step_500"), ["max_steps=2000"])
        changes
    """
    try:
        step_dir = resolve_checkpoint(checkpoint).absolute()
        saved = read_config_text(step_dir)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise RecipeError(
            [str(err)],
            title="Cannot resume:",
            hint="Pass a step_<N> folder written by the training loop, or its checkpoint_dir.",
        ) from None
    try:
        launch = read_config_text(step_dir, LAUNCH, optional=True)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise RecipeError(
            [f"run checkpoint {step_dir} has a corrupt {LAUNCH}: {err}"],
            title="Cannot resume:",
            hint=f"Repair {LAUNCH}, or move it aside and give the entry module and ranks as "
            "overrides (launch.entry=path/to/entry.py launch.nproc_per_node=N).",
        ) from None
    # The run checkpoint replaces the spec's resume_from.
    data = {"launch": launch, **saved, "resume_from": None}
    data["trainer"] = {**(saved.get("trainer") or {}), "resume_run": str(step_dir)}
    if branch is None:
        data.update(_folders_of(step_dir, saved))
    else:
        data.update(results_dir=str(branch.absolute()), checkpoint_dir=None)
    path = step_dir / CONFIG
    try:
        recipe = recipe_from_data(data, path, overrides)
    except RecipeError as err:
        if not launch:
            err.problems.append(
                f"{step_dir} has no {LAUNCH} (it was not written by `litegen launch`): "
                "give the entry module with launch.entry=path/to/entry.py"
            )
        raise RecipeError(err.problems, title=err.title, hint=err.hint) from None
    # The saved run with defaults filled in, to compare the overrides (and a moved folder) with.
    saved_folders = {key: saved.get(key) for key in ("results_dir", "checkpoint_dir")}
    # launch.entry may come from the overrides alone (a checkpoint without launch.yaml).
    launch_only = [item for item in overrides if item.startswith("launch.")]
    try:
        base = recipe_from_data({**data, **saved_folders}, path, launch_only).resolved_dict()
    except RecipeError:
        base = {**data, **saved_folders}
    changes = changed_fields(base, recipe.resolved_dict())
    fixed = [
        f"{line}: cannot change at resume: {FIXED_AT_RESUME[line.split(':')[0]]}"
        for line in changes
        if line.split(":")[0] in FIXED_AT_RESUME
    ]
    if fixed:
        raise RecipeError(
            fixed,
            title="Cannot resume:",
            hint="Drop those overrides, or start a new run with `litegen launch`.",
        )
    if not (step_dir / MANIFEST).is_file():
        recipe.warnings.append(
            f"run checkpoint {step_dir} has no {MANIFEST} (written by an older LiteGen): its "
            "files are loaded without being verified"
        )
    return recipe, [_with_note(line) for line in changes]


def _with_note(change: str) -> str:
    """A change line with how it takes effect, for the fields the checkpoint holds too."""
    note = APPLIED_TO_RESTORED.get(change.split(":")[0])
    return f"{change} ({note})" if note else change


def _folders_of(step_dir: Path, saved: dict[str, Any]) -> dict[str, str]:
    """results_dir and checkpoint_dir for a run continued from ``step_dir``: where it lies.

    The checkpoint_dir is the folder holding ``step_dir``, even when the run was moved (e.g.
    by ``litegen launch --overwrite``) or saved with relative paths; the results_dir keeps its
    place relative to the checkpoint_dir. A checkpoint_dir set apart from the results_dir stays
    apart.

    >>> _folders_of(Path("/new/run/step_4"), {"results_dir": "/old/run"})
    {'results_dir': '/new/run', 'checkpoint_dir': None}
    """
    here = step_dir.parent
    results = saved.get("results_dir") or os.path.join("results", saved.get("exp_name") or "")
    checkpoints = saved.get("checkpoint_dir")
    if not checkpoints or Path(checkpoints) == Path(results):
        return {"results_dir": str(here), "checkpoint_dir": None}
    if Path(results).is_absolute() != Path(checkpoints).is_absolute():
        return {"checkpoint_dir": str(here)}  # no common frame: results_dir stays as saved
    relative = os.path.relpath(results, checkpoints)
    return {"results_dir": os.path.normpath(here / relative), "checkpoint_dir": str(here)}


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """``'a.b: old -> new'`` for every leaf that differs.

    >>> changed_fields({"max_steps": 3, "lr": 0.1}, {"max_steps": 6, "lr": 0.1})
    ['max_steps: 3 -> 6']
    """
    old, new = _flatten(before), _flatten(after)
    return [
        f"{key}: {old.get(key)} -> {new.get(key)}"
        for key in sorted(set(old) | set(new))
        if key not in _IGNORED and old.get(key) != new.get(key)
    ]


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
