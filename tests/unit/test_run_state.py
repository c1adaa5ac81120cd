"""Run checkpoints in one process: exact resume, layout, retention, interrupted saves, bad input.

The multi-rank proofs (strategies, resharding, SIGKILL, `litegen resume`) are in
tests/distributed/test_resume.py; these run in a second each.
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
from torch import nn

import litegen
from litegen.checkpoint import run_state
from litegen.checkpoint.layout import COMPLETE, LATEST
from litegen.checkpoint.step_dirs import find_latest, resolve_checkpoint
from litegen.trainer import Trainer
from litegen.utils.config import MainConfig


@pytest.fixture(autouse=True)
def _own_process_group():
    """Each test joins a one-rank group; leave none behind for tests that fork ranks later."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def pairs(n: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, generator=gen), torch.randn(2, generator=gen)) for _ in range(n)]


def train_step(batch, model, step):
    data, target = batch
    # Noise from the global torch RNG: exact resume must restore it.
    noisy = data + 0.1 * torch.randn_like(data)
    return nn.functional.mse_loss(model(noisy), target)


def run(tmp_path, steps: int, out: int = 2, step_fn=train_step, **trainer) -> dict:
    """One training run through the real loop; returns losses, weights, EMA and the trainer."""
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path / "results"),
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "global_batch_size": 4,
            "max_steps": steps,
            "ema": {"enable": True, "decay": 0.9},
            "trainer": {"log_every": 1, "save_final": False, **trainer},
        }
    )
    gen = litegen.initialize(config)
    model = nn.Linear(4, out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    model, optimizer, loader = gen.prepare(model, optimizer, pairs())
    parts = {"model": model, "optimizer": optimizer, "loader": loader, "scheduler": scheduler}
    trainer = Trainer(gen, step_fn, parts)
    losses = trainer.fit()
    return {
        "losses": losses,
        "weights": gen.unwrap(model).state_dict(),
        "ema": gen.full_ema_state(),
        "trainer": trainer,
        "lr": optimizer.param_groups[0]["lr"],
    }


def assert_same(a: dict, b: dict) -> None:
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_stop_and_resume_equals_a_straight_run_bitwise(tmp_path, async_checkpoint):
    straight = run(tmp_path / "a", 6)
    first = run(tmp_path / "b", 3, checkpoint_every=3, async_checkpoint=async_checkpoint)
    ckpt = tmp_path / "b" / "ckpt"
    assert (ckpt / "step_3" / COMPLETE).is_file()
    assert (ckpt / LATEST).read_text().strip() == "step_3"
    assert MainConfig.load_yaml(ckpt / "step_3" / "config.yaml").max_steps == 3
    second = run(tmp_path / "b", 6, resume_run=str(ckpt))
    assert first["losses"] + second["losses"] == straight["losses"]
    assert_same(straight["weights"], second["weights"])
    assert_same(straight["ema"], second["ema"])
    assert second["lr"] == straight["lr"]  # the LR scheduler continued too


def test_train_step_gets_the_step_number_its_loss_is_logged_under(tmp_path):
    seen = []

    def recording_step(batch, model, step):
        seen.append(step)
        return train_step(batch, model, step)

    run(tmp_path / "a", 4, step_fn=recording_step)
    logged = [
        json.loads(line)["step"] for line in (tmp_path / "a" / "results" / "metrics.jsonl").open()
    ]
    assert seen == logged == [1, 2, 3, 4]
    seen.clear()
    run(tmp_path / "b", 2, step_fn=recording_step, checkpoint_every=2)
    run(tmp_path / "b", 4, step_fn=recording_step, resume_run=str(tmp_path / "b" / "ckpt"))
    assert seen == [1, 2, 3, 4]  # the resumed run goes on with step 3


def test_keep_last_keeps_the_newest_and_latest_points_to_the_last(tmp_path):
    run(tmp_path, 5, checkpoint_every=1, keep_last=2)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [LATEST, "step_4", "step_5"]
    assert find_latest(ckpt) == ckpt / "step_5"


def test_a_save_interrupted_before_completion_leaves_the_previous_one(tmp_path, monkeypatch):
    publish = run_state._publish

    def crash_at_step_4(tmp, final):
        if final.name == "step_4":
            raise KeyboardInterrupt("simulated crash before the checkpoint is complete")
        publish(tmp, final)

    monkeypatch.setattr(run_state, "_publish", crash_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, 6, checkpoint_every=2)
    ckpt = tmp_path / "ckpt"
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith(".step_4.tmp-")]
    assert len(leftovers) == 1  # the half-done save, never read
    assert find_latest(ckpt) == ckpt / "step_2" == resolve_checkpoint(ckpt)
    with pytest.raises(ValueError, match="partial"):
        resolve_checkpoint(ckpt / leftovers[0])
    monkeypatch.setattr(run_state, "_publish", publish)
    run(tmp_path, 4, checkpoint_every=2, resume_run=str(ckpt))  # resumes at 2, saves step_4
    assert sorted(p.name for p in ckpt.iterdir()) == [LATEST, "step_2", "step_4"]


def test_bad_checkpoints_name_the_path_and_write_nothing(tmp_path):
    run(tmp_path, 2, checkpoint_every=2)
    step = tmp_path / "ckpt" / "step_2"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    where = re.escape(str(step))

    def resume_from(path, out=2):
        run(tmp_path / "new", 4, out=out, resume_run=str(path))

    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        resume_from(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=rf"{where}.*shape mismatches: weight: file \(2, 4\)"):
        resume_from(step, out=3)
    meta = step / "model_0" / ".metadata"
    good = meta.read_bytes()
    meta.write_bytes(good[: len(good) // 2])
    # The manifest's sizes catch it before DCP would read it.
    with pytest.raises(ValueError, match=rf"{where} is corrupt: .*\.metadata has \d+ bytes"):
        resume_from(step)
    manifest = (step / "MANIFEST.json").read_bytes()
    (step / "MANIFEST.json").unlink()  # a checkpoint of an older LiteGen: DCP's own check
    with pytest.raises(ValueError, match=rf"{where} is corrupt: .*\.metadata cannot be read"):
        resume_from(step)
    (step / "MANIFEST.json").write_bytes(manifest)
    meta.write_bytes(good)
    (step / COMPLETE).unlink()
    with pytest.raises(ValueError, match=rf"{where} is partial"):
        resume_from(step)
    with pytest.raises(FileNotFoundError, match="no complete run checkpoint"):
        resume_from(tmp_path / "ckpt")
    (step / COMPLETE).write_text("ok\n")
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == before  # nothing under the old run; the new run wrote nothing either


seen: list[tuple[int, float]] = []


def recording_step(batch, model, step):
    """train_step that records which data each step saw."""
    seen.append((step, batch[0].sum().item()))
    return train_step(batch, model, step)


def nan_at_step_2(batch, model, step):
    """A NaN on the second optimizer step."""
    loss = recording_step(batch, model, step)
    return loss * float("nan") if step == 2 else loss


def test_nan_skip_keeps_the_data_order_and_abort_names_the_step(tmp_path):
    seen.clear()
    skipped = run(tmp_path / "skip", 4, step_fn=nan_at_step_2, on_nan="skip")
    skipped_seen = list(seen)
    seen.clear()
    clean = run(tmp_path / "clean", 4, step_fn=recording_step)
    # Same batch at every step: the skipped step consumed its data and advanced the cursor.
    assert skipped_seen == seen and [s for s, _ in seen] == [1, 2, 3, 4]
    assert skipped["trainer"].step == 4 and len(skipped["losses"]) == 3  # step 2 not logged
    assert skipped["lr"] == pytest.approx(0.05 * 0.9**3)  # the scheduler skipped one step
    assert clean["lr"] == pytest.approx(0.05 * 0.9**4)
    with pytest.raises(FloatingPointError, match=r"not finite at step 2.*on_nan: skip"):
        run(tmp_path / "abort", 4, step_fn=nan_at_step_2)


@pytest.mark.parametrize("damage", ["zeroed", "random", "truncated"])
def test_a_damaged_shard_is_refused_naming_the_file(tmp_path, damage):
    run(tmp_path, 2, checkpoint_every=2)
    step = tmp_path / "ckpt" / "step_2"
    manifest = json.loads((step / "MANIFEST.json").read_text())
    assert "model_0/.metadata" in manifest["files"] and "trainer/rank_0.pt" in manifest["files"]
    [shard] = sorted((step / "model_0").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    if damage == "zeroed":
        data[middle : middle + 64] = bytes(64)
    elif damage == "random":
        data[middle : middle + 64] = os.urandom(64)
    else:
        data = data[:middle]
    shard.write_bytes(bytes(data))
    why = "does not match its digest" if damage != "truncated" else r"has \d+ bytes, the manifest"
    with pytest.raises(ValueError, match=rf"{re.escape(str(shard))} {why}"):
        run(tmp_path / "new", 4, resume_run=str(step))
    assert not (tmp_path / "new" / "ckpt").exists()  # nothing trained, nothing saved


def test_a_checkpoint_without_manifest_loads_with_a_warning(tmp_path, caplog):
    run(tmp_path, 2, checkpoint_every=2)
    step = tmp_path / "ckpt" / "step_2"
    (step / "MANIFEST.json").unlink()  # as written by an older LiteGen
    with caplog.at_level(logging.WARNING, logger="litegen"):
        resumed = run(tmp_path, 3, resume_run=str(step))
    assert resumed["trainer"].step == 3
    assert "has no MANIFEST.json" in caplog.text and str(step) in caplog.text


def nan_weights_at_step_2(batch, model, step):
    loss = train_step(batch, model, step)
    if step == 2:  # a finite loss, but the weights go bad (as an overflowing update would)
        with torch.no_grad():
            next(model.parameters()).fill_(float("inf"))
    return loss


@pytest.mark.parametrize(
    ("step_fn", "error"),
    [
        (nan_at_step_2, r"loss is not finite at step 2.*No checkpoint of this run was written"),
        (
            nan_weights_at_step_2,
            r"state to save at step 2 is not finite \(ema\.weight, model\.weight\)",
        ),
    ],
)
def test_nothing_non_finite_is_committed_at_a_checkpoint_step(tmp_path, step_fn, error):
    with pytest.raises(FloatingPointError, match=error):
        run(tmp_path, 4, step_fn=step_fn, checkpoint_every=2, on_nan="abort")
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())


def test_every_file_of_a_run_follows_the_umask(tmp_path):
    # A group-shared run folder (umask 002) must be readable by the group, files made through
    # a temporary name included.
    previous = os.umask(0o002)
    try:
        run(tmp_path, 4, checkpoint_every=2, save_final=True)
    finally:
        os.umask(previous)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == COMPLETE for p in files) and any(p.name == LATEST for p in files)
    private = [str(p.relative_to(tmp_path)) for p in files if not p.stat().st_mode & 0o040]
    assert private == []


def test_the_checkpointer_holds_every_stateful_part_and_the_rank_file_keeps_its_keys(tmp_path):
    first = run(tmp_path, 2, checkpoint_every=2)
    trainer = first["trainer"]
    assert trainer.checkpointer is trainer.gen.checkpointer  # one object, held by both
    assert list(trainer.checkpointer.states()) == [
        "model_0",
        "trainer",
        "schedulers",
        "rng",
        "data",
    ]
    saved = torch.load(tmp_path / "ckpt" / "step_2" / "trainer" / "rank_0.pt", weights_only=True)
    assert list(saved) == ["step", "schedulers", "rng", "loader_generator", "data"]
    assert saved["step"] == 2 and len(saved["schedulers"]) == 1


def test_a_checkpoint_with_other_schedulers_is_refused_naming_it(tmp_path):
    run(tmp_path, 2, checkpoint_every=2)
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path / "results"),
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "global_batch_size": 4,
            "max_steps": 4,
            "ema": {"enable": True, "decay": 0.9},
            "trainer": {"save_final": False, "resume_run": str(tmp_path / "ckpt")},
        }
    )
    gen = litegen.initialize(config)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, loader = gen.prepare(model, optimizer, pairs())
    trainer = Trainer(gen, train_step, {"model": model, "optimizer": optimizer, "loader": loader})
    with pytest.raises(
        ValueError, match=r"run checkpoint .*step_2 holds 1 LR scheduler\(s\), this run has 0"
    ):
        trainer.fit()
