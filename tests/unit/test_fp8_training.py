"""FP8 training through torchao steps aside, with one warning, where it cannot run; on a GPU
with FP8 matmuls it converts the eligible layers (tests/gpu checks that part)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from litegen.precision.fp8_training import apply_fp8_training, fp8_unavailable


def test_fp8_training_steps_aside_on_a_cpu_with_one_warning(caplog):
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    with caplog.at_level(logging.WARNING, logger="litegen"):
        assert apply_fp8_training(model, "rowwise", torch.device("cpu")) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith("optimization.precision.fp8_linear: the device is cpu")
    assert all(type(m) in (nn.Linear, nn.GELU, nn.Sequential) for m in model.modules())


def test_fp8_training_names_what_a_gpu_lacks(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 8.0" in fp8_unavailable(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "torchao is not installed" in fp8_unavailable(cuda)
