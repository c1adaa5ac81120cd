"""Features that meet under a sharding strategy: EMA sampling right after validation."""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.models import PairDataset, loss_fn, make_model


def sample_after_validate(strategy: str) -> list[tuple[int, float]]:
    """Two steps with validate and sample both due at step 2, each running the model."""
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    seen = []

    def validate(model, loader):
        data, _ = next(iter(loader))
        return model(data.to(torch.float32)).float().pow(2).mean()

    def sample(model, gen, step):
        ema_out = model(torch.ones(2, 4, 8)).float().sum().item()
        seen.append((step, ema_out))
        return None

    with tempfile.TemporaryDirectory(prefix="litegen-test-") as results:
        config = MainConfig.from_dict(
            {
                "runtime": {"device": "cpu"},
                "results_dir": results,
                "global_batch_size": 8,
                "max_steps": 2,
                "ema": {"enable": True, "decay": 0.5},
                "optimization": {"parallel": {"strategy": strategy}},
                "trainer": {
                    "log_every": 1,
                    "save_final": False,
                    "sample_every": 2,
                    "validate_every": 2,
                },
            }
        )
        gen = litegen.initialize(config)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(40))
        parts = {"model": model, "optimizer": optimizer, "loader": loader}
        step = lambda batch, model: loss_fn(model, batch)  # noqa: E731
        Trainer(gen, step, parts, sample_fn=sample, validate_fn=validate).fit()
        # The model's own weights came back: a forward after the hooks runs on them.
        after = model(torch.ones(2, 4, 8)).float().sum().item()
        ema = gen.full_ema_state()
    return {"seen": seen, "after": after, "ema_keys": len(ema)}


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1", "zero1", "zero2", "ddp"])
def test_sampling_from_the_ema_right_after_validation(strategy):
    ranks = run_ranks(sample_after_validate, 2, strategy)
    assert [step for step, _ in ranks[0]["seen"]] == [2]
    assert ranks[0]["seen"][0][1] != ranks[0]["after"]  # the EMA weights, not the model's
