"""The launch-vs-hand comparison cuts both sides' records into the same windows."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from launch_vs_hand import window_rates


def per_step(seconds: list[float], batch: int = 4) -> list[dict]:
    """hand_loop.py's records: one per step, each with its own samples/s."""
    return [{"step": i + 1, "samples_per_s": batch / s} for i, s in enumerate(seconds)]


def per_window(seconds: list[float], window: int, batch: int = 4) -> list[dict]:
    """The trainer's records every ``window`` steps, each with the rate since the last one."""
    return [
        {"step": end, "samples_per_s": window * batch / sum(seconds[end - window : end])}
        for end in range(window, len(seconds) + 1, window)
    ]


def test_per_step_and_logged_windows_give_the_same_rates():
    seconds = [5.0, 5.0, 0.1, 0.3, 0.2, 0.2, 0.1, 0.1, 0.4, 0.4]
    from_steps = window_rates(per_step(seconds), first=2, last=10, window=2)
    from_windows = window_rates(per_window(seconds, 2), first=2, last=10, window=2)
    assert from_steps == pytest.approx(from_windows)
    assert from_steps == pytest.approx([8 / 0.4, 8 / 0.4, 8 / 0.2, 8 / 0.8])  # warm-up left out


def test_windows_cut_by_the_range_or_by_records_are_left_out():
    seconds = [0.1] * 9
    assert len(window_rates(per_step(seconds), first=0, last=9, window=4)) == 2  # 9 = 4 + 4 + 1
    assert window_rates(per_window(seconds, 3), first=0, last=9, window=2) == []
