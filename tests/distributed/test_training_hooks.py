"""Hooks of a sharded model: samples on every rank from the EMA weights, training unchanged;
the validation loss averaged over ranks."""

from __future__ import annotations

import json
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
                "trainer": {
                    "log_every": 1,
                    "save_final": False,
                    "sample_every": sample_every,
                    "validate_every": 4 if sample_every else 0,
                },
            }
        )
        gen = litegen.initialize(config)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(40))
        parts = {"model": model, "optimizer": optimizer, "loader": loader}
        sample_fn = sample if sample_every else None
        validate_fn = (lambda: float(torch.distributed.get_rank())) if sample_every else None
        step = lambda batch, model: loss_fn(model, batch)  # noqa: E731
        trainer = Trainer(gen, step, parts, sample_fn=sample_fn, validate_fn=validate_fn)
        losses = trainer.fit()
        metrics = Path(results, "metrics.jsonl")
        val = [json.loads(x).get("val_loss") for x in metrics.open()] if metrics.exists() else []
        written = sorted(str(p.relative_to(results)) for p in Path(results).glob("samples/*/*"))
        weights = {k: v.clone() for k, v in gen.full_model_state(model).items()}
    return {"losses": losses, "calls": calls, "written": written, "weights": weights, "val": val}


def test_fsdp2_samples_on_every_rank_from_the_ema_and_trains_the_same():
    with_samples = run_ranks(train, 2, "fsdp2", 2)
    without = run_ranks(train, 2, "fsdp2", 0)
    for rank in (0, 1):
        assert with_samples[rank]["calls"] == [(2, False, True), (4, False, True)]
    assert with_samples[0]["written"] == [
        "samples/step_2/samples.png",
        "samples/step_4/samples.png",
    ]
    assert with_samples[0]["val"] == [None, None, None, 0.5]  # ranks 0 and 1 averaged
    assert with_samples[0]["losses"] == without[0]["losses"]
    for key, value in without[0]["weights"].items():
        assert torch.equal(with_samples[0]["weights"][key], value), key
