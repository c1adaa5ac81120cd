"""Checkpoint files: naming rules, atomic writes, validated loads."""

from litegen.checkpoint.files import (
    atomic_write,
    check_model_state,
    checkpoint_path,
    load_state,
    optimizer_path_for,
    save_state,
)

__all__ = [
    "atomic_write",
    "check_model_state",
    "checkpoint_path",
    "load_state",
    "optimizer_path_for",
    "save_state",
]
