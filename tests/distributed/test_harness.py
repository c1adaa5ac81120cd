"""The rank harness itself: a native crash is run once more, other deaths are not.

uv run pytest tests/distributed/test_harness.py
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.distributed.harness import RankCrash, RankError, run_ranks


def die_first_time(marker_dir: str, signum: int) -> int:
    """Rank 0 dies from ``signum`` the first time the marker is missing; every rank returns."""
    rank = int(os.environ["RANK"])
    marker = Path(marker_dir, "died")
    if rank == 0 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signum)
    return rank


def always_segfault() -> None:
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSEGV)


def raise_then_segfault() -> None:
    if os.environ["RANK"] == "0":
        raise ValueError("a real error")
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT])
def test_a_native_crash_once_is_run_again_with_a_warning(tmp_path, signum):
    name = signal.Signals(signum).name
    with pytest.warns(UserWarning, match=f"(?s){name}.*once more"):
        assert run_ranks(die_first_time, 2, str(tmp_path), signum) == [0, 1]
    assert (tmp_path / "died").exists()


def test_a_segfault_twice_fails():
    with pytest.warns(UserWarning, match="once more"), pytest.raises(RankCrash, match="SIGSEGV"):
        run_ranks(always_segfault, 2)


def test_a_kill_is_not_run_again(tmp_path):
    with pytest.raises(RankError, match="process died") as failure:
        run_ranks(die_first_time, 2, str(tmp_path), signal.SIGKILL)
    assert not isinstance(failure.value, RankCrash)


def test_a_python_error_beside_a_crash_is_reported_not_retried():
    with pytest.raises(RankError, match="a real error") as failure:
        run_ranks(raise_then_segfault, 2)
    assert not isinstance(failure.value, RankCrash)
