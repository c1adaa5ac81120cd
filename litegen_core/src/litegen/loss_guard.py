"""Catch a non-finite loss on any rank without making the host wait for the GPU every step.

``trainer.on_nan: skip`` must decide before the optimizer step, so it syncs once per step.
``abort`` (the default) does not need to: step N's flag is all-reduced and copied to pinned host
memory in the background, and read when step N + 1 is queued (or at the end), by which time
it has long arrived. The error still names step N.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def nonfinite_flag(loss_sum: torch.Tensor) -> torch.Tensor:
    """1.0 when the loss is NaN or inf on any rank, else 0.0 (all-reduced, on the device)."""
    flag = (~torch.isfinite(loss_sum)).float().reshape(1)
    dist.all_reduce(flag)
    return flag


class LossGuard:
    """Deferred non-finite checks for ``on_nan: abort``; an immediate one for ``skip``.

    Example:
        >>> guard = LossGuard(device)
        >>> guard.defer(loss_sum, step=7)   # queues the check, returns at once
        >>> guard.raise_if_nonfinite()      # raises FloatingPointError naming step 7
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        self._host = torch.zeros(1, pin_memory=self.cuda)

    @staticmethod
    def finite_now(loss_sum: torch.Tensor) -> bool:
        """The blocking check, for ``on_nan: skip``."""
        return nonfinite_flag(loss_sum).item() == 0

    def defer(self, loss_sum: torch.Tensor, step: int) -> None:
        """Check the previous step's flag, then queue this step's."""
        self.raise_if_nonfinite()
        flag = nonfinite_flag(loss_sum)
        if self.cuda:
            self._host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (step, self._host, event)
        else:
            self._pending = (step, flag, None)

    def raise_if_nonfinite(self) -> None:
        """Raise for a queued flag that says the loss was not finite; clear it either way."""
        if self._pending is None:
            return
        step, flag, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # that step's copy only; later work keeps running
        if flag.item() != 0:
            raise FloatingPointError(
                f"the loss is not finite at step {step} on at least one rank; training stopped "
                "(set trainer.on_nan: skip to skip such steps)."
            )
