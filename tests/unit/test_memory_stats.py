"""Peak device memory for the training log, since the last call."""

from __future__ import annotations

import types

import torch

from litegen.memory import format_peak_memory, peak_memory_since_last_call

GIB = 2**30


def test_cpu_has_no_peaks():
    assert peak_memory_since_last_call("cpu") == {}
    assert format_peak_memory({}) == ""


def test_cuda_peaks_in_gib_and_percent_reset_at_each_call(monkeypatch):
    # The allocator's statistics, as torch.cuda reports them on a 100 GiB device.
    state = {"allocated": 30 * GIB, "reserved": 40 * GIB}

    def reset(device):
        state["allocated"], state["reserved"] = 1 * GIB, 2 * GIB

    fake = {
        "get_device_properties": lambda device: types.SimpleNamespace(total_memory=100 * GIB),
        "max_memory_allocated": lambda device: state["allocated"],
        "max_memory_reserved": lambda device: state["reserved"],
        "reset_peak_memory_stats": reset,
    }
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    peaks = peak_memory_since_last_call(torch.device("cuda", 0))
    assert peaks == {
        "peak_allocated_gib": 30.0,
        "peak_reserved_gib": 40.0,
        "peak_allocated_pct": 30.0,
        "peak_reserved_pct": 40.0,
    }
    assert format_peak_memory(peaks) == "mem 30.0/40.0 GiB (30%)"
    assert peak_memory_since_last_call("cuda:0")["peak_allocated_gib"] == 1.0  # since the reset
