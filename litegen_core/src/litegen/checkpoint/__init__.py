"""Everything checkpoints: single files (names, atomic writes, validated loads), run checkpoint
folders (``run_state`` writes and loads them, ``step_dirs`` finds and checks them, ``manifest``
verifies their files), ZeRO's sharded optimizer files (``zero_state``) and the checkpoint half
of the LiteGen object (``api``)."""

from litegen.checkpoint.files import (
    atomic_write,
    atomic_write_text,
    check_model_state,
    checkpoint_path,
    load_state,
    optimizer_path_for,
    replace_dir,
    save_state,
)
from litegen.checkpoint.run_state import RunCheckpointer, Trainable, capture_rng, restore_rng
from litegen.checkpoint.step_dirs import (
    find_latest,
    list_checkpoints,
    resolve_checkpoint,
    step_dir_name,
)

__all__ = [
    "RunCheckpointer",
    "Trainable",
    "atomic_write",
    "atomic_write_text",
    "capture_rng",
    "check_model_state",
    "checkpoint_path",
    "find_latest",
    "list_checkpoints",
    "load_state",
    "optimizer_path_for",
    "replace_dir",
    "resolve_checkpoint",
    "restore_rng",
    "save_state",
    "step_dir_name",
]
