"""Catch a non-finite loss on any rank without making the host wait for the GPU.

``trainer.on_nan: skip`` must decide before the optimizer step, so it syncs once per step.
``abort`` (the default) does not need to: step N's flag goes to the host behind the step's
kernels (:class:`litegen.instruments.readback.Readback`) and is read once it has arrived, at a
later step (at most two steps later) or at the end. The error still names step N. Across ranks
the flag is all-reduced; a single rank has nothing to reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from litegen.instruments.readback import Readback


def nonfinite_flag(loss_sum: torch.Tensor) -> torch.Tensor:
    """1.0 when the loss is NaN or inf on any rank, else 0.0 (all-reduced, on the device)."""
    flag = (~torch.isfinite(loss_sum)).float().reshape(1)
    if _several_ranks():
        dist.all_reduce(flag)
    return flag


def _several_ranks() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


class LossGuard:
    """Deferred non-finite checks for ``on_nan: abort``; an immediate one for ``skip``.

    Example:
        >>> guard = LossGuard(torch.device("cpu"))
        >>> guard.defer(torch.tensor(float("nan")), step=7)  # queues the check, returns at once
        >>> guard.raise_if_nonfinite()
        Traceback (most recent call last):
        FloatingPointError: ...step 7...
    """

    def __init__(self, device: torch.device, note: Callable[[], str] | None = None) -> None:
        """``note``: called at an abort, its text ends the error (e.g. the last good checkpoint)."""
        self._note = note
        self._pending = Readback(device)
        # One rank reads its loss itself; several read the all-reduced flag.
        self._reduce = _several_ranks()

    @staticmethod
    def finite_now(loss_sum: torch.Tensor) -> bool:
        """The blocking check, for ``on_nan: skip``."""
        return nonfinite_flag(loss_sum).item() == 0

    def defer(self, loss_sum: torch.Tensor, step: int) -> None:
        """Check the flags that have arrived (those of earlier steps), then queue this step's."""
        self._check(wait=False)
        self._pending.push(nonfinite_flag(loss_sum) if self._reduce else loss_sum, step)

    def raise_if_nonfinite(self) -> None:
        """Wait for every queued flag; raise for the first that says the loss was not finite."""
        self._check(wait=True)

    def _check(self, wait: bool) -> None:
        for step, (value,), _ in self._pending.ready(wait=wait):
            if (value != 0) if self._reduce else not math.isfinite(value):
                note = f" {self._note()}" if self._note is not None else ""
                raise FloatingPointError(
                    f"the loss is not finite at step {step} on at least one rank; training "
                    f"stopped (set trainer.on_nan: skip to skip such steps).{note}"
                )
