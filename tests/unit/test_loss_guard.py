"""The deferred non-finite check: nothing raised while queuing, the right step named after."""

import pytest
import torch

from litegen.instruments.loss_guard import LossGuard


def test_a_nan_is_reported_one_step_later_naming_its_step(group):
    guard = LossGuard(torch.device("cpu"))
    guard.defer(torch.tensor(1.0), step=4)
    guard.defer(torch.tensor(float("nan")), step=5)  # step 4 was fine: no error yet
    with pytest.raises(FloatingPointError, match=r"not finite at step 5"):
        guard.defer(torch.tensor(1.0), step=6)
    guard.raise_if_nonfinite()  # the flag was consumed; nothing pending


def test_the_last_step_is_checked_at_the_end(group):
    guard = LossGuard(torch.device("cpu"))
    guard.defer(torch.tensor(float("inf")), step=9)
    with pytest.raises(FloatingPointError, match=r"step 9"):
        guard.raise_if_nonfinite()


def test_the_immediate_check_for_skip(group):
    assert LossGuard.finite_now(torch.tensor(2.0))
    assert not LossGuard.finite_now(torch.tensor(float("nan")))
