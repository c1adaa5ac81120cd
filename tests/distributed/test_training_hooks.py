"""Samples of a sharded model: every rank takes part, from the EMA weights, training unchanged."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.models import PairDataset, loss_fn, make_model

pytestmark = pytest.mark.slow


def train(strategy: str, sample_every: int) -> dict:
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    calls = []

    def sample(model, gen, step):
        # Collectives on every rank: the weights the hook sees, and the EMA gathered directly.
        view = gen.full_model_state(model)
        ema = gen.full_ema_state()
        calls.append((step, model.training, all(torch.equal(view[k], ema[k]) for k in ema)))
        return torch.rand(2, 3, 4, 4)

    with tempfile.TemporaryDirectory(prefix="litegen-test-") as results:
        config = MainConfig.from_dict(
            {
                "runtime": {"device": "cpu"},
                "results_dir": results,
                "global_batch_size": 8,
                "max_steps": 4,
                "ema": {"enable": True, "decay": 0.9},
                "optimization": {"parallel": {"strategy": strategy}},
                "trainer": {"log_every": 1, "save_final": False, "sample_every": sample_every},
            }
        )
        gen = litegen.initialize(config)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(40))
        parts = {"model": model, "optimizer": optimizer, "loader": loader}
        sample_fn = sample if sample_every else None
        losses = Trainer(
            gen, lambda batch, model: loss_fn(model, batch), parts, sample_fn=sample_fn
        ).fit()
        written = sorted(str(p.relative_to(results)) for p in Path(results).glob("samples/*/*"))
        weights = {k: v.clone() for k, v in gen.full_model_state(model).items()}
        gen.close()
    return {"losses": losses, "calls": calls, "written": written, "weights": weights}


def with_and_without_samples(strategy: str) -> tuple[dict, dict]:
    return train(strategy, sample_every=2), train(strategy, sample_every=0)


def test_fsdp2_samples_on_every_rank_from_the_ema_and_trains_the_same():
    runs = run_ranks(with_and_without_samples, 2, "fsdp2")
    with_samples, without = [run[0] for run in runs], [run[1] for run in runs]
    for rank in (0, 1):
        assert with_samples[rank]["calls"] == [(2, False, True), (4, False, True)]
    assert with_samples[0]["written"] == [
        "samples/step_2/samples.png",
        "samples/step_4/samples.png",
    ]
    assert with_samples[0]["losses"] == without[0]["losses"]
    for key, value in without[0]["weights"].items():
        assert torch.equal(with_samples[0]["weights"][key], value), key
