"""Load a user's entry module: the ``build(config)`` and ``train_step(batch, ...)`` it defines.

module = load_entry("recipes/digits_dit.py")          # a file
module = load_entry("recipes.digits_dit", base_dir)   # or an importable module name
names = parts_to_prepare(module.build(config), "recipes/digits_dit.py")
check_inputs(config, "litegen.finetune")              # its check_inputs(config) hook, if any

What ``build(config)`` returns is a dict of named objects. Models (``nn.Module``), optimizers,
``DataLoader`` objects and datasets are prepared; a dataset is a ``torch.utils.data.Dataset`` (map
style or ``IterableDataset``) or another object with ``__getitem__`` and ``__len__`` that is
not a list, tuple, dict, string, tensor or array (a Hugging Face ``datasets.Dataset``, say).
Everything else (a held-out ``(x, y)`` tuple, a tensor, an LR scheduler, plain values) reaches
the hooks unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REQUIRED = ("build", "train_step")
# Containers that are data for the hooks (a held-out tuple), never a training set; tensors
# too (:func:`_plain`). torch is imported on first use: loading an entry and calling its
# check_inputs hook (the CLI, before any rank starts) needs none.
_CONTAINERS = (list, tuple, dict, str, bytes, set, frozenset)


def _plain() -> tuple[type, ...]:
    import torch

    return (*_CONTAINERS, torch.Tensor)


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


def built_kind(obj: Any) -> str | None:
    """How ``run_entry`` treats one value of the ``build(config)`` dict: the kind ``prepare``
    takes it as (:func:`litegen.runtime.prepare_arguments.preparable_kind`), or None for a value that
    reaches ``train_step`` and the hooks unchanged (containers, tensors and arrays are data
    for the hooks, never a training set).

    >>> import torch
    >>> from torch import nn
    >>> built_kind(nn.Linear(2, 2)), built_kind((torch.zeros(2), torch.zeros(2)))
    ('model', None)
    """
    from litegen.runtime.prepare_arguments import preparable_kind

    if isinstance(obj, _plain()) or type(obj).__module__ == "numpy":
        return None
    return preparable_kind(obj)


def parts_to_prepare(built: Any, entry: str) -> list[str]:
    """The names of the ``build(config)`` values to prepare; ``ValueError`` naming the fix when
    it is not a dict with exactly one dataset (or DataLoader) and at least one optimizer.

    >>> import torch
    >>> from torch import nn
    >>> from torch.utils.data import TensorDataset
    >>> m = nn.Linear(4, 1)
    >>> o = torch.optim.SGD(m.parameters(), lr=0.1)
    >>> ds, x, y = TensorDataset(torch.randn(8, 4)), torch.randn(2, 4), torch.randn(2, 1)
    >>> parts_to_prepare({"model": m, "optimizer": o, "data": ds, "val": (x, y)}, "e.py")
    ['model', 'optimizer', 'data']
    """
    if not isinstance(built, dict) or not built:
        raise ValueError(
            f"build(config) in entry module '{entry}' must return a non-empty dict of named "
            f"objects to prepare (model, optimizer, dataset, ...), got {type(built).__name__}."
        )
    kinds = {name: built_kind(obj) for name, obj in built.items()}
    datasets = [name for name, kind in kinds.items() if kind in ("dataset", "dataloader")]
    if len(datasets) != 1:
        passed = [
            f"'{name}' ({type(built[name]).__name__})"
            for name, kind in kinds.items()
            if kind is None and isinstance(built[name], _plain())
        ]
        found = f"{len(datasets)} ({', '.join(repr(n) for n in datasets)})" if datasets else "none"
        raise ValueError(
            f"build(config) in entry module '{entry}' must return exactly one training dataset "
            f"or DataLoader, found {found}. A dataset is a torch.utils.data.Dataset (or an "
            "object with __getitem__ and __len__); lists, tuples, dicts and tensors reach "
            "train_step and the hooks unchanged"
            + (f" ({', '.join(passed)})" if passed else "")
            + ". Wrap the training samples in a Dataset (torch.utils.data.TensorDataset for "
            "tensors) and return any other data as plain values."
        )
    if "optimizer" not in kinds.values():
        raise ValueError(
            f"build(config) in entry module '{entry}' returned no optimizer; return the "
            "optimizer of the trained model in the dict, e.g. 'optimizer': torch.optim.AdamW(...)."
        )
    return [name for name, kind in kinds.items() if kind is not None]


def check_inputs(config: Any, entry: str, base_dir: str | Path | None = None) -> None:
    """Call the entry module's optional ``check_inputs(config)`` hook: the bad input it can find
    without building anything (a missing folder or file), raised as a ``ValueError`` naming the
    path and the fix. Cheap, and needs no process group: a launcher calls it before the ranks
    start (``run_entry`` calls it too, before ``initialize``).

    Example:
        >>> from litegen.config import MainConfig
        >>> _ = Path("checked_entry.py").write_text(
        ...     "def build(config): ...\\n"
        ...     "def train_step(batch): ...\\n"
        ...     "def check_inputs(config):\\n"
        ...     "    raise ValueError('no folder data/; create it')\\n"
        ... )
        >>> check_inputs(MainConfig(), "checked_entry.py", ".")
        Traceback (most recent call last):
        ValueError: no folder data/; create it
    """
    hook = getattr(load_entry(entry, base_dir), "check_inputs", None)
    if callable(hook):
        hook(config)
