"""The training loop's stateful parts of a run checkpoint, and what resuming changes besides them.

The checkpointer (``gen.checkpointer``, litegen/runtime/checkpointer.py) holds these parts
beside the models; each part's ``state_dict()`` entries are keys of ``trainer/rank_<r>.pt``
(docs/resume.md), and each ``load_state_dict`` takes that whole dict back.

Example::

    gen.checkpointer.start_run(run_parts(train_state, loader, schedulers, device))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from litegen.checkpoint.rng import capture_rng, restore_rng
from litegen.data import data_state, load_data_state

log = logging.getLogger("litegen")


@dataclass
class TrainState:
    """The loop's own state: the number of optimizer steps taken.

    Example::

        TrainState(step=10).state_dict()  # {'step': 10}
    """

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


@dataclass
class Schedulers:
    """The run's LR schedulers; a checkpoint with another number of them does not fit."""

    schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [scheduler.state_dict() for scheduler in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self.schedulers):
            raise ValueError(
                f"holds {len(saved)} LR scheduler(s), this run has {len(self.schedulers)}; "
                "build the same schedulers to resume."
            )
        for scheduler, scheduler_state in zip(self.schedulers, saved, strict=True):
            scheduler.load_state_dict(scheduler_state)


@dataclass
class DataPosition:
    """Where this rank's data stream stands (litegen/data/state.py); older checkpoints hold
    none. ``step`` returns the loop's current step."""

    loader: Any
    step: Callable[[], int]

    def state_dict(self) -> dict[str, Any]:
        return {"data": data_state(self.loader, self.step())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_data_state(self.loader, state.get("data"), int(state["step"]))


@dataclass
class RngState:
    """The global RNG states and the loader's generator.

    Loading keeps them aside: creating the loader's iterator draws a worker seed from the RNG,
    and the saved states are those after that draw, so :meth:`restore` puts them back only
    once the loop has made its iterator.
    """

    loader: Any
    device: torch.device
    pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        generator = self.loader.generator
        return {
            "rng": capture_rng(self.device),
            "loader_generator": generator.get_state() if generator is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = state

    def restore(self) -> None:
        """Put back the states a resume loaded (nothing when none did)."""
        state, self.pending = self.pending, None
        if state is None:
            return
        restore_rng(state["rng"], self.device)
        generator = self.loader.generator
        if generator is not None and state.get("loader_generator") is not None:
            generator.set_state(state["loader_generator"])


def apply_changed_optimizer_settings(
    saved: dict[str, Any],
    config: Any,
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler],
) -> None:
    """``lr`` and ``weight_decay`` changed since the checkpoint (``saved``: its config) reach
    the restored optimizers and schedulers, which otherwise keep the checkpoint's values.

    Every param group's ``lr`` and ``initial_lr`` and every scheduler's ``base_lrs`` are
    scaled by new/old, so the schedule keeps its shape (and groups their ratios) at the new
    rate; the groups whose ``weight_decay`` was the old value take the new one.

    Example::

        apply_changed_optimizer_settings(read_config_text(path), config, optimizers, schedulers)
    """
    old_lr, new_lr = float(saved.get("lr", config.lr)), config.lr
    if old_lr != new_lr:
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for key in ("lr", "initial_lr"):
                    if key in group:
                        group[key] = _rescaled(group[key], old_lr, new_lr)
        for scheduler in schedulers:
            scheduler.base_lrs = [_rescaled(lr, old_lr, new_lr) for lr in scheduler.base_lrs]
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        log.info("lr changed at resume: %g -> %g (optimizer and schedulers)", old_lr, new_lr)
    old_decay = float(saved.get("weight_decay", config.weight_decay))
    new_decay = config.weight_decay
    if old_decay != new_decay:
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                if group.get("weight_decay") == old_decay:
                    group["weight_decay"] = new_decay
        log.info("weight_decay changed at resume: %g -> %g", old_decay, new_decay)


def _rescaled(value: Any, old: float, new: float) -> Any:
    """A learning rate (float or tensor) moved from the old base rate to the new one."""
    return value * (new / old) if old else new


__all__ = [
    "DataPosition",
    "RngState",
    "Schedulers",
    "TrainState",
    "apply_changed_optimizer_settings",
]
