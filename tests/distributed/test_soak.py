"""The soak test: one run with a checkpoint every step, stopped again and again at random
(SIGKILL of a rank or of the launcher, SIGTERM of the launcher) and resumed each time, ends with
the losses and weights of a run that never stopped; no checkpoint is ever non-finite, damaged,
or lost (``latest`` never moves back).

$LITEGEN_SOAK_CYCLES stops (default 2, for CI), $LITEGEN_SOAK_SEED the random choices:

    LITEGEN_SOAK_CYCLES=20 uv run --locked pytest -q tests/distributed/test_soak.py
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

from litegen.checkpoint.step_dirs import find_latest, list_checkpoints, resolve_checkpoint
from tests.distributed.harness import run_ranks
from tests.distributed.test_launch import finish, litegen, read_metrics
from tests.distributed.test_reliability import (
    alive,
    config_of,
    logged_steps,
    ranks_of,
    wait_until,
    write_recipe,
)
from tests.distributed.test_resume import assert_same_weights, run_entry_in_ranks

pytestmark = pytest.mark.slow

CYCLES = int(os.environ.get("LITEGEN_SOAK_CYCLES", "2"))
STEPS = 2 * CYCLES + 4  # room for every stop to land mid-run


def soak_config(root: Path, **extra) -> dict:
    trainer = {"log_every": 1, "checkpoint_every": 1, "keep_last": 3}
    return config_of(root, max_steps=STEPS, auto_resume=True, trainer=trainer, **extra)


def assert_checkpoints_sound(ckpt: Path) -> int:
    """Every complete checkpoint passes the size checks and holds only finite tensors; returns
    the step ``latest`` resolves to (0: none yet)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for _step, folder in list_checkpoints(ckpt):
        resolve_checkpoint(folder)
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(folder / "model_0", Path(tmp) / "state.pt")
            state = torch.load(Path(tmp) / "state.pt", weights_only=False)
        tensors = [t for part in state.values() for t in _tensors(part)]
        assert tensors and all(torch.isfinite(t).all() for t in tensors), folder
    latest = find_latest(ckpt)
    return int(latest.name.removeprefix("step_")) if latest else 0


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def test_random_stops_and_resumes_end_as_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    run_ranks(run_entry_in_ranks, 2, soak_config(reference))
    root = tmp_path / "run"
    ckpt = root / "ckpt"
    recipe = write_recipe(tmp_path, soak_config(root, step_sleep=0.05))
    rng = random.Random(int(os.environ.get("LITEGEN_SOAK_SEED", "0")))
    history, latest = [], 0
    for cycle in range(CYCLES):
        if find_latest(ckpt) is None:
            proc = litegen("launch", recipe, cwd=tmp_path)  # auto_resume: continues if it can
        else:
            proc = litegen("resume", "--from", ckpt, cwd=tmp_path)
        how = rng.choice(["SIGKILL rank 0", "SIGKILL rank 1", "SIGKILL launcher", "SIGTERM"])
        target = logged_steps(root) + rng.randint(0, 2)
        wait_until(lambda: len(ranks_of(proc.pid)) == 2 or proc.poll() is not None, 240)  # noqa: B023
        wait_until(lambda: logged_steps(root) >= target or proc.poll() is not None, 240, 0.02)  # noqa: B023
        time.sleep(rng.uniform(0, 0.15))
        ranks = ranks_of(proc.pid)
        if proc.poll() is not None or not ranks:
            code, out = finish(proc)
            history.append(f"cycle {cycle}: the run had ended")
            assert code == 0, "\n".join([*history, out[-4000:]])
            break
        if how.endswith("launcher"):
            os.kill(proc.pid, signal.SIGKILL)
        elif how == "SIGTERM":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.kill(ranks[int(how[-1])], signal.SIGKILL)
        code, out = finish(proc)
        assert wait_until(lambda: not any(alive(pid) for pid in ranks), 10), history  # noqa: B023
        now = assert_checkpoints_sound(ckpt)
        history.append(f"cycle {cycle}: {how} after step {target}: exit {code}, latest {now}")
        assert now >= latest, "\n".join(history)  # a checkpoint was lost
        latest = now
    if not history or "ended" not in history[-1]:
        start = ("resume", "--from", ckpt) if find_latest(ckpt) else ("launch", recipe)
        code, out = finish(litegen(*start, cwd=tmp_path))
        assert code == 0, "\n".join([*history, out[-4000:]])
    assert_checkpoints_sound(ckpt)
    assert [m["loss"] for m in read_metrics(root)] == [m["loss"] for m in read_metrics(reference)]
    assert_same_weights(ckpt / "tiny.pth", torch.load(reference / "ckpt" / "tiny.pth"))
    assert latest < STEPS  # the stops did land mid-run
    print("\n".join(history))
