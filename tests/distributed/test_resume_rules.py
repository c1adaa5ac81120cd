"""The rules of `litegen resume` (docs/resume.md), through the CLI on 2 gloo CPU ranks.

- a resume from a step older than the folder's newest is refused (exit 2) and replaces
  nothing; ``--branch`` continues in a new folder, ``--move-newer-aside`` moves the newer steps
  aside; both end with the weights of an uninterrupted run;
- an override at resume is applied (lr reaches the restored optimizer and scheduler), or
  refused naming the field;
- a non-finite loss at a checkpoint step commits nothing: ``latest`` stays the last good
  step, which the error names.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.distributed.harness import run_ranks
from tests.distributed.test_launch import finish, litegen, read_metrics
from tests.distributed.test_resume import (
    FIXTURE,
    STEPS,
    assert_same_weights,
    entry_config,
    run_entry_in_ranks,
)
from tests.unit.test_run_folder import snapshot

pytestmark = pytest.mark.slow

ENTRY = (f"launch.entry={FIXTURE}", "launch.nproc_per_node=2")
DECAY = 0.9


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run of STEPS steps with a checkpoint every 2 steps and an LR schedule (lr * 0.9**step);
    no launch.yaml: forked ranks."""
    root = tmp_path_factory.mktemp("finished")
    run_ranks(run_entry_in_ranks, 2, entry_config(root, lr_decay=DECAY))
    return root


def copy_of(run: Path, into: Path) -> Path:
    shutil.copytree(run, into)
    return into / "ckpt"


def test_a_resume_from_an_older_step_is_refused_and_replaces_nothing(tmp_path, finished):
    ckpt = copy_of(finished, tmp_path / "run")
    before = snapshot(ckpt)
    code, out = finish(litegen("resume", "--from", ckpt / "step_2", *ENTRY, cwd=tmp_path))
    assert code == 2, out[-4000:]
    flat = " ".join(out.replace("│", " ").split())
    assert "holds checkpoints newer than step_2: step_4, step_6" in flat
    assert "--branch" in flat and "--move-newer-aside" in flat
    assert snapshot(ckpt).keys() == before.keys()
    assert {k: v for k, v in snapshot(ckpt).items() if k != "."} == {
        k: v for k, v in before.items() if k != "."
    }


def test_move_newer_aside_keeps_them_and_the_run_goes_on(tmp_path, finished):
    ckpt = copy_of(finished, tmp_path / "run")
    step_6 = snapshot(ckpt / "step_6")
    args = ("resume", "--from", ckpt / "step_2", "--move-newer-aside", *ENTRY)
    code, out = finish(litegen(*args, cwd=tmp_path))
    assert code == 0, out[-4000:]
    (aside,) = tmp_path.glob("run/ckpt.old-*")
    assert f"Moved step_4, step_6 (newer than step_2) aside to {aside}" in out.replace("\n", "")
    moved = ["latest", "metrics.jsonl", "step_4", "step_6", "tiny.optim_state.pth", "tiny.pth"]
    assert sorted(p.name for p in aside.iterdir()) == moved
    assert [m["step"] for m in read_metrics(aside)] == list(range(1, STEPS + 1))  # a copy
    assert snapshot(aside / "step_6") == step_6
    assert_same_weights(ckpt / "tiny.pth", torch.load(aside / "tiny.pth", weights_only=True))


def test_branch_continues_in_a_new_folder_and_leaves_the_old_one(tmp_path, finished):
    ckpt = copy_of(finished, tmp_path / "run")
    before = snapshot(tmp_path / "run")
    branch = tmp_path / "branch"
    args = ("resume", "--from", ckpt / "step_2", "--branch", branch, *ENTRY)
    code, out = finish(litegen(*args, cwd=tmp_path))
    assert code == 0, out[-4000:]
    assert snapshot(tmp_path / "run") == before
    assert [m["step"] for m in read_metrics(branch)] == list(range(3, STEPS + 1))
    assert sorted(p.name for p in branch.glob("step_*")) == ["step_4", "step_6"]
    assert_same_weights(branch / "tiny.pth", torch.load(ckpt / "tiny.pth", weights_only=True))


def test_an_lr_override_at_resume_reaches_the_optimizer_and_the_schedule(tmp_path, finished):
    ckpt = copy_of(finished, tmp_path / "run")
    args = ("resume", "--from", ckpt, "max_steps=8", "lr=0.005", *ENTRY)
    code, out = finish(litegen(*args, cwd=tmp_path))
    assert code == 0, out[-4000:]
    assert "changed: lr: 0.01 -> 0.005 (applied: the restored optimizer's" in out
    lrs = {m["step"]: m["lr"] for m in read_metrics(tmp_path / "run")}
    assert lrs[STEPS] == pytest.approx(0.01 * DECAY**STEPS)  # before: the saved rate
    # After: the new rate on the same schedule (the scheduler steps after each step).
    assert lrs[STEPS + 1] == pytest.approx(0.005 * DECAY ** (STEPS + 1))
    assert lrs[STEPS + 2] == pytest.approx(0.005 * DECAY ** (STEPS + 2))


def test_a_field_fixed_at_resume_is_refused_naming_it(tmp_path, finished):
    ckpt = copy_of(finished, tmp_path / "run")
    before = snapshot(tmp_path / "run")
    args = ("resume", "--from", ckpt, "global_batch_size=16", "max_steps=8", *ENTRY)
    code, out = finish(litegen(*args, cwd=tmp_path))
    assert code == 2, out[-4000:]
    flat = " ".join(out.replace("│", " ").split())
    assert "global_batch_size: 8 -> 16: cannot change at resume: the step is the data" in flat
    assert "max_steps" not in flat  # only the refused field is named
    assert snapshot(tmp_path / "run") == before


def test_a_nan_at_a_checkpoint_step_commits_nothing_and_names_the_last_good(tmp_path):
    root = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    data = {"launch": {"entry": str(FIXTURE), "nproc_per_node": 2}}
    recipe.write_text(yaml.safe_dump({**data, **entry_config(root, nan_at_step=4)}))
    code, out = finish(litegen("launch", recipe, cwd=tmp_path))
    assert code == 1, out[-4000:]
    flat = " ".join(out.replace("│", " ").split())
    ckpt = root / "ckpt"
    assert "the loss is not finite at step 4" in flat
    bare = "".join(flat.split())  # rich wraps long paths anywhere
    assert f"Thelastgoodcheckpointis{ckpt / 'step_2'}" in bare
    assert (ckpt / "latest").read_text().strip() == "step_2"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_2"]
