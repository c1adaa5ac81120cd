"""Load a user's entry module: the ``build(config)`` and ``train_step(batch, ...)`` it defines.

module = load_entry("recipes/digits_dit.py")          # a file
module = load_entry("recipes.digits_dit", base_dir)   # or an importable module name
check_inputs(config, "recipes/finetune.py")           # its check_inputs(config) hook, if any
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REQUIRED = ("build", "train_step")


def load_entry(entry: str, base_dir: str | Path | None = None) -> ModuleType:
    """Import the entry module by file path (``.py``) or dotted name and check its functions.

    Relative paths and module names resolve against ``base_dir`` (the recipe's folder) first.
    """
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    if entry.endswith(".py"):
        path = Path(entry) if Path(entry).is_absolute() else base / entry
        if not path.is_file():
            raise ValueError(
                f"launch.entry: entry module file {path} does not exist; give a path to a .py "
                "file relative to the recipe's folder, or an importable module name."
            )
        # Let the entry import its sibling modules, as `python path/to/entry.py` would.
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        for folder in (base, Path.cwd()):
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
        try:
            module = importlib.import_module(entry)
        except ModuleNotFoundError as err:
            if err.name and entry.startswith(err.name):
                raise ValueError(
                    f"launch.entry: cannot import entry module '{entry}' (searched {base} and "
                    "the Python path); check the name, or give a path to a .py file."
                ) from err
            raise
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ValueError(
            f"entry module '{entry}' ({getattr(module, '__file__', '?')}) does not define "
            f"{' and '.join(missing)}; an entry module defines build(config) -> dict of the "
            "objects to prepare, and train_step(batch, ...) -> loss."
        )
    return module


def check_inputs(config: Any, entry: str, base_dir: str | Path | None = None) -> None:
    """Call the entry module's optional ``check_inputs(config)`` hook: the bad input it can find
    without building anything (a missing folder or file), raised as a ``ValueError`` naming the
    path and the fix. Cheap, and needs no process group: a launcher calls it before the ranks
    start (``run_entry`` calls it too, before ``initialize``).

    Example:
        >>> check_inputs(recipe.config, recipe.launch.entry, recipe.base_dir)  # doctest: +SKIP
    """
    hook = getattr(load_entry(entry, base_dir), "check_inputs", None)
    if callable(hook):
        hook(config)
