"""FLOP counting, the peak table, throughput metrics and MFU in the trainer's log."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from torch import nn

import litegen
from litegen import flops
from litegen.compile import compile_blocks
from litegen.flops import FlopCounter, StepThroughput, mfu, peak_flops, throughput
from litegen.trainer import Trainer
from litegen.utils.config import CompileConfig, MainConfig


def test_counter_sees_forward_and_backward_matmuls():
    layer = nn.Linear(8, 4, bias=False)
    x = torch.randn(16, 8, requires_grad=True)
    with FlopCounter() as counter:
        layer(x).sum().backward()
    forward = 2 * 16 * 8 * 4
    assert counter.flops == 3 * forward  # backward: one matmul for dx, one for dW


def test_counter_counts_compiled_blocks_eagerly():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))

    def count(model):
        with FlopCounter() as counter:
            model(torch.randn(4, 8)).sum().backward()
        return counter.flops

    compiled = make()
    assert compile_blocks(compiled, CompileConfig(enabled=True), backend="eager") == ["0", "1", "2"]
    torch._dynamo.reset()
    assert count(compiled) == count(make()) > 0


def test_peak_comes_from_the_override_or_the_table():
    assert peak_flops("cpu") is None
    assert peak_flops("cpu", override_tflops=2.0) == 2e12
    with pytest.raises(ValueError, match="positive"):
        peak_flops("cpu", override_tflops=-1.0)
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H200"),
    ):
        assert peak_flops("cuda") == 790e12  # measured, not the 989 of the datasheet
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H100 PCIe"),
    ):
        assert peak_flops("cuda") == flops.PEAK_TFLOPS["H100 PCIe"].used * 1e12


def test_throughput_and_mfu_arithmetic():
    assert mfu(4e14, step_seconds=1.0, peak=8e14) == 0.5
    assert mfu(4e14, step_seconds=1.0, peak=None) is None
    out = throughput(
        steps=10,
        seconds=2.0,
        samples_per_step=8,
        world_size=2,
        tokens_per_sample=256,
        flops_per_step_per_gpu=1e12,
        peak=1e13,
    )
    assert out == {
        "samples_per_s": 40.0,
        "tokens_per_s": 10240.0,
        "tokens_per_s_per_gpu": 5120.0,
        "mfu": 0.5,
    }
    assert throughput(steps=1, seconds=1.0, samples_per_step=4, world_size=1) == {
        "samples_per_s": 4.0
    }


class Counted(nn.Linear):
    tokens_per_sample = 3

    def flops_per_sample(self) -> float:
        return 1e6


def test_step_throughput_prefers_the_models_own_count_and_skips_counting_without_peak():
    meter = StepThroughput(
        Counted(2, 2), device="cpu", world_size=2, samples_per_step=8, peak_tflops=1.0
    )
    assert meter.flops_per_step_per_gpu == 1e6 * 8 / 2 and meter.tokens_per_sample == 3
    assert meter.count().__class__.__name__ == "nullcontext"
    no_peak = StepThroughput(nn.Linear(2, 2), device="cpu", world_size=1, samples_per_step=8)
    assert no_peak.count().__class__.__name__ == "nullcontext"
    assert "mfu" not in no_peak.metrics(steps=1, seconds=1.0)


def test_trainer_logs_tokens_per_second_and_mfu(tmp_path):
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path),
            "exp_name": "mfu",
            "global_batch_size": 4,
            "max_steps": 4,
            "trainer": {
                "log_every": 2,
                "save_final": False,
                "peak_tflops": 1e-6,
                "tokens_per_sample": 5,
            },
        }
    )
    gen = litegen.initialize(config)
    model = nn.Linear(4, 2, bias=False)
    data = [(torch.randn(4), torch.randn(2)) for _ in range(16)]
    model, optimizer, loader = gen.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)

    def train_step(batch, model):
        x, y = batch
        return (model(x) - y).square().mean()

    trainer = Trainer(gen, train_step, {"model": model, "optimizer": optimizer, "loader": loader})
    trainer.fit()
    assert trainer.throughput.flops_per_step_per_gpu == 2 * (2 * 4 * 4 * 2)  # forward + dW
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert record["tokens_per_s"] == pytest.approx(5 * record["samples_per_s"])
        assert record["tokens_per_s_per_gpu"] == record["tokens_per_s"]  # one rank
        assert record["mfu"] > 0
