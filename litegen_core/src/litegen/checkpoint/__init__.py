"""Everything checkpoints: the names of a run's files (``layout``, torch-free), the formats a
state lies on disk in (``atomic``: complete-or-absent writes, torch-free; ``formats``: the table; ``files``: torch.save and safetensors;
``zero_state``: ZeRO's sharded optimizer files; ``interop``: diffusers folders), run checkpoint
folders (``run_state`` writes them, ``run_load`` loads them, ``step_dirs`` finds and checks
them, ``manifest`` verifies their files) and the checkpoint half of the LiteGen object (``api``).

Nothing is imported at load: the names below load their module (and torch) on first use, so the
CLI imports ``litegen.checkpoint.layout`` without torch.

Example:
    >>> from litegen.checkpoint import load_state, step_dir_name
    >>> step_dir_name(10)
    'step_10'
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that declares it
_HOMES = {
    "atomic_write": "atomic",
    "atomic_write_text": "atomic",
    "check_model_state": "files",
    "checkpoint_path": "files",
    "load_state": "files",
    "optimizer_path_for": "files",
    "replace_dir": "atomic",
    "save_state": "files",
    "step_dir_name": "layout",
    "capture_rng": "rng",
    "restore_rng": "rng",
    "RunCheckpointer": "run_state",
    "find_latest": "step_dirs",
    "list_checkpoints": "step_dirs",
    "resolve_checkpoint": "step_dirs",
    "Trainable": "trainable",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"litegen.checkpoint.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'litegen.checkpoint' has no attribute {name!r}")
