"""litegen.finetune.export from a run checkpoint written by hand: the weights it reads (the model's, or the
EMA's over them) and the bad input `litegen export` refuses. The recipes' runs export end to end
in tests/distributed/test_finetune_recipes.py."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from typer.testing import CliRunner

from litegen.finetune.export import checkpoint_has_ema, checkpoint_weights
from litegen_cli.app import app


def step_folder(root: Path, config: dict, state: dict) -> Path:
    """A complete run checkpoint as the training loop lays it out, from one process."""
    step = root / "step_3"
    with warnings.catch_warnings():  # DCP says it saves in one process: it is meant to
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=str(step / "model_0"), no_dist=True)
    (step / "trainer").mkdir()
    torch.save({"step": 3}, step / "trainer" / "rank_0.pt")
    (step / "config.yaml").write_text(yaml.safe_dump(config))
    (step / "COMPLETE").write_text("")
    return step


def test_checkpoint_weights_are_the_model_s_or_the_ema_s_over_them(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].requires_grad_(False)  # frozen: the EMA averages the Linear alone
    saved = {k: torch.randn_like(v.float()).to(v.dtype) for k, v in model.state_dict().items()}
    ema = {"0.weight": torch.randn(4, 3), "0.bias": torch.randn(4)}  # the trainable ones
    step = step_folder(tmp_path, {}, {"model": saved, "ema": ema})

    assert checkpoint_has_ema(step / "model_0")
    plain = checkpoint_weights(step / "model_0", model, ema=False)
    assert plain.keys() == saved.keys()
    assert all(torch.equal(plain[k], saved[k]) for k in saved)
    averaged = checkpoint_weights(step / "model_0", model, ema=True)
    assert all(torch.equal(averaged[k], ema.get(k, saved[k])) for k in saved)
    model[1].requires_grad_(True)  # now the EMA lacks trained tensors: refused, not the model's
    with pytest.raises(ValueError, match=r"holds no EMA of \['1.weight', '1.bias'\].*--no-ema"):
        checkpoint_weights(step / "model_0", model, ema=True)


def test_export_refuses_a_run_without_a_pipeline_folder_and_a_missing_checkpoint(
    tmp_path: Path,
) -> None:
    step_folder(tmp_path, {"exp_name": "digits"}, {"model": {"w": torch.zeros(2)}})
    result = CliRunner().invoke(app, ["export", "--from", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "has no finetune.pipeline" in result.output.replace("\n", "")
    nowhere = ["export", "--from", str(tmp_path / "nowhere")]
    missing = CliRunner().invoke(app, nowhere, env={"COLUMNS": "250"})
    assert missing.exit_code == 2 and "does not exist" in missing.output
    assert not (tmp_path / "exports").exists()
