"""The training loop's hint for the dtype mismatch ``cast_model`` without autocast causes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import litegen
from litegen.trainer import Trainer
from litegen.trainer.hints import cast_model_hint
from litegen.utils.config import MainConfig


@pytest.fixture(autouse=True)
def _own_process_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train_step(batch, model):
    data, _ = batch  # FP32, as a data loader gives it
    return model(data).square().mean()


def fit(tmp_path, trainer: dict) -> None:
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path),
            "global_batch_size": 2,
            "max_steps": 1,
            "optimization": {"precision": {"cast_model": "bf16"}},
            "trainer": {"save_final": False, **trainer},
        }
    )
    gen = litegen.initialize(config)
    model = nn.Linear(4, 2)
    model, optimizer, loader = gen.prepare(
        model, torch.optim.AdamW(model.parameters()), [(torch.randn(4), 0) for _ in range(4)]
    )
    Trainer(gen, train_step, {"model": model, "optimizer": optimizer, "loader": loader}).fit()


def test_fp32_inputs_to_a_cast_model_name_the_setting_and_the_fix(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"(?s)dtype.*cast_model is bf16.*trainer.autocast: bf16"
    ):
        fit(tmp_path, {})


def test_with_autocast_the_same_step_trains(tmp_path):
    fit(tmp_path, {"autocast": "bf16"})


@pytest.mark.parametrize(
    ("error", "hinted"),
    [
        (RuntimeError("Input type (float) and bias type (c10::BFloat16) should be the same"), True),
        (RuntimeError("mat1 and mat2 must have the same dtype, but got Float and BFloat16"), True),
        (RuntimeError("expected scalar type Long but found BFloat16"), False),  # e.g. targets
        (NotImplementedError("float and BFloat16"), False),  # subclasses pass through untouched
    ],
)
def test_only_float_against_the_cast_dtype_gets_the_hint(error, hinted):
    config = MainConfig.from_dict({"optimization": {"precision": {"cast_model": "bf16"}}})
    assert (cast_model_hint(config, error) is not None) == hinted
    with_autocast = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"autocast": "bf16"})}
    )
    assert cast_model_hint(with_autocast, error) is None
