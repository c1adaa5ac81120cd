"""Run checkpoints of the training loop: save, find the one to continue from, resume exactly.

:class:`~litegen.trainer.loop.Trainer` inherits these methods; they use its ``gen``, ``config``,
``loader``, ``schedulers``, ``step`` and ``checkpointer`` (litegen/checkpoint/run_state.py).

Example::

    trainer.resume("results/dit/step_1000"); trainer.fit()
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from litegen.checkpoint.layout import CONFIG, LAUNCH, step_of
from litegen.checkpoint.rng import capture_rng, restore_rng
from litegen.checkpoint.step_dirs import (
    find_latest,
    newer_checkpoints,
    read_config_text,
    resolve_checkpoint,
)
from litegen.data import data_state, load_data_state

log = logging.getLogger("litegen")


class RunCheckpoints:
    """The run-checkpoint half of the trainer (module docstring)."""

    def resume_source(self) -> Path | None:
        """The run checkpoint :meth:`fit` continues from, the same on every rank (or None).

        After a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) and with ``auto_resume``
        it is the latest complete one in ``checkpoint_dir``; otherwise ``trainer.resume_run``.
        """
        self._resume_checked = True
        choice: list[str | None] = [None]
        if self.gen.is_main_process:
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0
            explicit = self.config.trainer.resume_run
            if restarted or (self.config.auto_resume and not explicit):
                latest = find_latest(self.config.get_checkpoint_dir())
                choice[0] = str(latest) if latest else None
            if choice[0] is None and explicit:
                choice[0] = explicit
        # Rank 0 decides: ranks reading the folder at slightly different times must agree.
        dist.broadcast_object_list(choice, src=0)
        return Path(choice[0]) if choice[0] else None

    def resume(self, path: str | Path) -> None:
        """Continue from a run checkpoint: weights, optimizer, EMA, step, data position, RNG.

        Example::

            trainer.resume("results/dit/step_1000"); trainer.fit()
        """
        self._resume_checked = True
        path = resolve_checkpoint(path)
        self._refuse_to_replace_newer(path)
        state = self.checkpointer.load(path)
        if len(state["schedulers"]) != len(self.schedulers):
            raise ValueError(
                f"run checkpoint {path} holds {len(state['schedulers'])} LR scheduler(s), this "
                f"run has {len(self.schedulers)}; build the same schedulers to resume."
            )
        for scheduler, scheduler_state in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(scheduler_state)
        self._apply_changed_optimizer_settings(read_config_text(path))
        self.step = int(state["step"])
        # The data position (litegen/data/state.py); older checkpoints hold none.
        load_data_state(self.loader, state.get("data"), self.step)
        self._restore_after_iter = state
        log.info("resumed from %s at step %d", path, self.step)

    def _refuse_to_replace_newer(self, path: Path) -> None:
        """A run continued from an older step would overwrite the newer steps in its folder."""
        step = step_of(path)
        target = Path(self.config.get_checkpoint_dir())
        newer = newer_checkpoints(target, step) if step is not None else []
        if newer:
            raise ValueError(
                f"{target} holds checkpoints newer than {path.name}, which this run continues "
                f"from: {', '.join(p.name for p in newer)}; continuing there would replace them. "
                "Continue in another folder (litegen resume --branch NEW_FOLDER, or "
                "checkpoint_dir=NEW_FOLDER), or move them aside (litegen resume "
                "--move-newer-aside)."
            )

    def _apply_changed_optimizer_settings(self, saved: dict[str, Any]) -> None:
        """``lr`` and ``weight_decay`` changed since the checkpoint reach the restored optimizer
        and schedulers, which otherwise keep the checkpoint's values.

        Every param group's ``lr`` and ``initial_lr`` and every scheduler's ``base_lrs`` are
        scaled by new/old, so the schedule keeps its shape (and groups their ratios) at the new
        rate; the groups whose ``weight_decay`` was the old value take the new one.
        """
        old_lr, new_lr = float(saved.get("lr", self.config.lr)), self.config.lr
        if old_lr != new_lr:
            for optimizer in self.optimizers:
                for group in optimizer.param_groups:
                    for key in ("lr", "initial_lr"):
                        if key in group:
                            group[key] = _rescaled(group[key], old_lr, new_lr)
            for scheduler in self.schedulers:
                scheduler.base_lrs = [_rescaled(lr, old_lr, new_lr) for lr in scheduler.base_lrs]
                scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
            log.info("lr changed at resume: %g -> %g (optimizer and schedulers)", old_lr, new_lr)
        old_decay = float(saved.get("weight_decay", self.config.weight_decay))
        new_decay = self.config.weight_decay
        if old_decay != new_decay:
            for optimizer in self.optimizers:
                for group in optimizer.param_groups:
                    if group.get("weight_decay") == old_decay:
                        group["weight_decay"] = new_decay
            log.info("weight_decay changed at resume: %g -> %g", old_decay, new_decay)

    def _rank_state(self) -> dict[str, Any]:
        """This rank's part of a run checkpoint (the model side goes through DCP)."""
        generator = self.loader.generator
        return {
            "step": self.step,
            "schedulers": [scheduler.state_dict() for scheduler in self.schedulers],
            "rng": capture_rng(self.gen.device),
            "loader_generator": generator.get_state() if generator is not None else None,
            "data": data_state(self.loader, self.step),
        }

    def _restore_rng(self, state: dict[str, Any]) -> None:
        restore_rng(state["rng"], self.gen.device)
        if self.loader.generator is not None and state.get("loader_generator") is not None:
            self.loader.generator.set_state(state["loader_generator"])

    def save_run_checkpoint(self) -> None:
        """Write ``<checkpoint_dir>/step_<step>/`` (layout: checkpoint/layout.py). Every rank.

        The deferred loss checks of the steps up to this one come first: no checkpoint of a
        step whose loss was not finite is ever written.
        """
        self.loss_guard.raise_if_nonfinite()
        # Absolute paths: `litegen resume` from any folder continues in the same folders.
        files = {CONFIG: self.config.with_absolute_paths().to_yaml()}
        if self.run_info:
            files[LAUNCH] = yaml.safe_dump(self.run_info, sort_keys=False)
        self.checkpointer.save(self.step, self._rank_state(), files)

    def save_checkpoint(self, step: int | None) -> None:
        """Model, optimizer and (when enabled) EMA files, named by the spec's rules."""
        self.gen.save_model(step=step)
        self.gen.save_optimizer(step=step)
        if self.gen.ema is not None:
            self.gen.save_ema(step=step)


def _rescaled(value: Any, old: float, new: float) -> Any:
    """A learning rate (float or tensor) moved from the old base rate to the new one."""
    return value * (new / old) if old else new


__all__ = ["RunCheckpoints"]
