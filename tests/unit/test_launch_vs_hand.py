"""The launch-vs-hand comparison cuts both sides' records into the same windows."""

import json
import subprocess
from unittest import mock

import pytest

from scripts.bench.launch_vs_hand import run_side, window_rates


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


def test_the_launch_sides_peak_is_the_largest_logged_one(tmp_path):
    # The trainer resets the peak at every log, so what the entry's finish reads at the end
    # (summary.json) misses the steps before the last log.
    def fake_run(command, **_):
        records = [{"step": 1, "peak_allocated_gib": 40.0}, {"step": 2, "peak_allocated_gib": 41.5}]
        (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
        (tmp_path / "summary.json").write_text(json.dumps({"peak_memory_gib": 18.6}))
        return subprocess.CompletedProcess(command, 0, stdout="")

    with mock.patch("scripts.bench.launch_vs_hand.subprocess.run", fake_run):
        records, summary = run_side("launch", tmp_path / "recipe.yaml", tmp_path)
    assert len(records) == 2
    assert summary["peak_memory_gib"] == 41.5
