"""Which run checkpoint a training run continues from, and which it must not continue from.

Example::

    resume_source(config)  # results/dit/step_1000 after a torchrun restart, say
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from litegen.checkpoint.layout import step_of
from litegen.checkpoint.step_dirs import find_latest, newer_checkpoints
from litegen.config import MainConfig


def resume_source(config: MainConfig) -> Path | None:
    """The run checkpoint to continue from, the same on every rank (or None). Every rank.

    After a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) and with ``auto_resume`` it
    is the latest complete one in ``checkpoint_dir``; otherwise ``trainer.resume_run`` (which
    ``litegen resume --from`` sets).

    Example::

        resume_source(config)  # None for a fresh run
    """
    choice: list[str | None] = [None]
    if dist.get_rank() == 0:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0
        explicit = config.trainer.resume_run
        if restarted or (config.auto_resume and not explicit):
            latest = find_latest(config.get_checkpoint_dir())
            choice[0] = str(latest) if latest else None
        if choice[0] is None and explicit:
            choice[0] = explicit
    # Rank 0 decides: ranks reading the folder at slightly different times must agree.
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def refuse_to_replace_newer(path: Path, checkpoint_dir: str | Path) -> None:
    """A run continued from ``path`` would overwrite the newer steps in ``checkpoint_dir``: a
    ValueError naming them and the two ways out.

    Example::

        refuse_to_replace_newer(Path("results/dit/step_20"), "results/dit")
    """
    step = step_of(path)
    target = Path(checkpoint_dir)
    newer = newer_checkpoints(target, step) if step is not None else []
    if newer:
        raise ValueError(
            f"{target} holds checkpoints newer than {path.name}, which this run continues "
            f"from: {', '.join(p.name for p in newer)}; continuing there would replace them. "
            "Continue in another folder (litegen resume --branch NEW_FOLDER, or "
            "checkpoint_dir=NEW_FOLDER), or move them aside (litegen resume "
            "--move-newer-aside)."
        )
