"""The training log on CUDA: peak memory in every record, a profiler trace and memory snapshot."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

import litegen
from litegen.trainer import Trainer
from litegen.utils.config import MainConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_records_carry_peak_memory_and_the_profiler_writes_trace_and_snapshot(tmp_path, caplog):
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cuda"},
            "results_dir": str(tmp_path),
            "global_batch_size": 8,
            "max_steps": 3,
            "trainer": {"log_every": 1, "save_final": False, "profile": {"start": 2, "steps": 2}},
        }
    )
    gen = litegen.initialize(config)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    data = [(torch.randn(256), 0) for _ in range(24)]
    model, optimizer, loader = gen.prepare(model, torch.optim.AdamW(model.parameters()), data)
    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    with caplog.at_level(logging.INFO, logger="litegen"):
        Trainer(gen, lambda batch, model: model(batch[0]).square().mean(), parts).fit()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert len(records) == 3
    for record in records:
        assert 0 < record["peak_allocated_gib"] <= record["peak_reserved_gib"]
        assert 0 < record["peak_allocated_pct"] <= record["peak_reserved_pct"] < 100
    trace = json.loads((tmp_path / "profile" / "rank_0.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
    assert (tmp_path / "profile" / "memory_rank_0.pickle").stat().st_size > 0
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile")]
    assert summary and "device kernels" in summary[0]
