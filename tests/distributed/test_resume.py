"""Exact resume and fault tolerance on gloo CPU ranks (docs/resume.md).

- ddp / zero1 / fsdp2: "N steps straight" == "K steps, stop, resume, N-K steps", bitwise
  (losses with torch-RNG noise, final weights, EMA).
- fsdp2 saved at 4 ranks resumed at 2, and 2 -> 4: losses match within fp32 tolerance.
- kill -9 during a checkpoint save, then `litegen resume`: the previous checkpoint loads and
  the run ends with the weights of an uninterrupted run.
- a rank SIGKILLed mid-run under `max_restarts: 1`: torchrun restarts the group, which resumes
  by itself and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from tests.distributed.harness import RankError, run_ranks
from tests.distributed.models import PairDataset, loss_fn, make_model
from tests.distributed.test_launch import finish, litegen

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "resume_entry.py"
STEPS, STOP = 6, 3


# -- in-process training, inside the ranks -----------------------------------------------------
def noisy_step(batch, model):
    data, target = batch
    return loss_fn(model, (data + 0.1 * torch.randn_like(data), target))


def plain_step(batch, model):
    return loss_fn(model, batch)


def train(
    strategy: str, root: str, steps: int, step_fn=noisy_step, masters=False, **trainer
) -> dict:
    """TinyDiT + AdamW + LambdaLR + EMA through the real loop; full weights and EMA back.

    ``masters``: a bf16 model stepped through FP32 master weights.
    """
    optimization = {"parallel": {"strategy": strategy}}
    if masters:
        optimization |= {
            "precision": {"cast_model": "bf16"},
            "optimizer": {"fp32_master_weights": True},
        }
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": root,
            "checkpoint_dir": f"{root}/ckpt",
            "global_batch_size": 8,
            "max_steps": steps,
            "ema": {"enable": True, "decay": 0.9},
            "optimization": optimization,
            "trainer": {"log_every": 1, "save_final": False, **trainer},
        }
    )
    gen = litegen.initialize(config)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(64))
    parts = {"model": model, "optimizer": optimizer, "loader": loader, "scheduler": scheduler}
    losses = Trainer(gen, step_fn, parts).fit()
    return {
        "losses": losses,
        "weights": gen.models[-1].strategy.full_model_state(model),
        "ema": gen.full_ema_state(),
    }


def stop_and_resume(strategy: str, tmp: str, masters: bool = False) -> dict:
    out = {"straight": train(strategy, f"{tmp}/a", STEPS, masters=masters)}
    # The second leg saves asynchronously: the copy must not see later updates.
    out["first"] = train(
        strategy, f"{tmp}/b", STOP, masters=masters, checkpoint_every=STOP, async_checkpoint=True
    )
    out["resumed"] = train(strategy, f"{tmp}/b", STEPS, masters=masters, resume_run=f"{tmp}/b/ckpt")
    return out


@pytest.mark.parametrize(
    ("strategy", "masters"),
    [
        ("ddp", False),
        ("zero1", False),
        ("fsdp2", False),
        # bf16 parameters, FP32 masters in the optimizer state
        ("ddp", True),
        ("zero1", True),
        ("fsdp2", True),
    ],
)
def test_stop_and_resume_is_bitwise_equal(tmp_path, strategy, masters):
    result = run_ranks(stop_and_resume, 2, strategy, str(tmp_path), masters)[0]
    straight, first, resumed = result["straight"], result["first"], result["resumed"]
    assert len(straight["losses"]) == STEPS
    assert first["losses"] + resumed["losses"] == straight["losses"]
    for key in ("weights", "ema"):
        for name, tensor in straight[key].items():
            assert torch.equal(tensor, resumed[key][name]), (key, name)
    # Sanity: the run did train, so equality is not of two untouched models.
    assert not torch.equal(first["weights"]["head.weight"], resumed["weights"]["head.weight"])


# -- resharding: 4 ranks <-> 2 ranks ------------------------------------------------------------
def save_leg(tmp: str) -> None:
    train("fsdp2", tmp, STOP, step_fn=plain_step, checkpoint_every=STOP)


def four_rank_suite(tmp: str) -> dict:
    out = {"straight": train("fsdp2", f"{tmp}/straight", STEPS, step_fn=plain_step)}
    save_leg(f"{tmp}/four")
    out["2to4"] = train(
        "fsdp2", f"{tmp}/two", STEPS, step_fn=plain_step, resume_run=f"{tmp}/two/ckpt"
    )
    return out


def resume_at(tmp: str) -> dict:
    return train("fsdp2", tmp, STEPS, step_fn=plain_step, resume_run=f"{tmp}/ckpt")


def test_resume_at_another_world_size_continues_the_same_run(tmp_path):
    tmp = str(tmp_path)
    run_ranks(save_leg, 2, f"{tmp}/two")
    four = run_ranks(four_rank_suite, 4, tmp)[0]
    four_to_two = run_ranks(resume_at, 2, f"{tmp}/four")[0]
    reference = four["straight"]
    for resumed in (four["2to4"], four_to_two):
        assert len(resumed["losses"]) == STEPS - STOP
        torch.testing.assert_close(
            torch.tensor(resumed["losses"]),
            torch.tensor(reference["losses"][STOP:]),
            rtol=1e-5,
            atol=1e-6,
        )
        for key in ("weights", "ema"):
            torch.testing.assert_close(resumed[key], reference[key], rtol=1e-5, atol=1e-6)


# -- real crashes: kill -9 during a save, a rank killed under torchrun --------------------------
def entry_config(root: Path, **extra) -> dict:
    return {
        "exp_name": "tiny",
        "results_dir": str(root),
        "checkpoint_dir": str(root / "ckpt"),
        "runtime": {"device": "cpu", "distributed": {"backend": "gloo", "dist_timeout": 60}},
        "max_steps": STEPS,
        "global_batch_size": 8,
        "lr": 0.01,
        "trainer": {"log_every": 1, "checkpoint_every": 2},
        **extra,
    }


def run_entry_in_ranks(config: dict, kill_during_save_of: str | None = None) -> list[float]:
    from litegen.checkpoint import run_state
    from litegen.trainer import run_entry
    from litegen.utils.config import MainConfig

    if kill_during_save_of and int(os.environ["RANK"]) == 0:
        publish = run_state._publish

        def killed_midway(tmp, final):
            # Every rank's DCP files and trainer state are written; the marker is not.
            if final.name == kill_during_save_of:
                os.kill(os.getpid(), signal.SIGKILL)
            publish(tmp, final)

        run_state._publish = killed_midway
    return run_entry(MainConfig.from_dict(config), str(FIXTURE))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("uninterrupted")
    run_ranks(run_entry_in_ranks, 2, entry_config(root))
    return torch.load(root / "ckpt" / "tiny.pth", weights_only=True)


def assert_same_weights(path: Path, expected: dict[str, torch.Tensor]) -> None:
    state = torch.load(path, weights_only=True)
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_kill_during_save_keeps_the_previous_checkpoint_and_resume_finishes(
    tmp_path, uninterrupted
):
    root = tmp_path / "run"
    with pytest.raises(RankError, match="process died"):
        run_ranks(run_entry_in_ranks, 2, entry_config(root), "step_4")
    ckpt = root / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_2"
    assert not (ckpt / "step_4").exists()
    assert any(p.name.startswith(".step_4.tmp-") for p in ckpt.iterdir())

    code, out = finish(litegen("resume", "--from", ckpt, "trainer.log_every=2", cwd=tmp_path))
    assert code == 0, out[-4000:]
    assert f"Resuming from {ckpt / 'step_2'}" in out
    assert "changed: trainer.log_every: 1 -> 2" in out
    assert_same_weights(ckpt / "tiny.pth", uninterrupted)
    assert not any(p.name.startswith(".step_") for p in ckpt.iterdir())  # leftover removed


def test_sigkilled_rank_is_restarted_by_torchrun_and_the_run_finishes(tmp_path, uninterrupted):
    root = tmp_path / "run"
    data = {
        "launch": {"entry": str(FIXTURE), "nproc_per_node": 2, "max_restarts": 1},
        **entry_config(root, kill_rank1_at_step=4),
    }
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    code, out = finish(litegen("launch", recipe, cwd=tmp_path))
    assert code == 0, out[-4000:]
    assert_same_weights(root / "ckpt" / "tiny.pth", uninterrupted)
    steps = [yaml.safe_load(line)["step"] for line in (root / "metrics.jsonl").open()]
    # Killed during step 4: the restarted group went on from step_2 and ran step 3 again; its
    # first record was dropped when the run continued, so every step appears once.
    assert steps == [1, 2, 3, 4, 5, 6]


def test_resume_from_a_partial_checkpoint_exits_2_and_writes_nothing(tmp_path):
    step = tmp_path / "ckpt" / "step_2"
    (step / "trainer").mkdir(parents=True)
    (step / "config.yaml").write_text(yaml.safe_dump({"results_dir": str(tmp_path / "out")}))
    code, out = finish(litegen("resume", "--from", step, cwd=tmp_path))
    assert code == 2, out[-4000:]
    assert "Cannot resume" in out and "partial" in out and "step_2" in out
    assert not (tmp_path / "out").exists()
