"""scripts/lab/gpu_power.py with a stand-in for NVML: what its reading makes of the counters."""

from __future__ import annotations

import ctypes
import time

import torch

from scripts.lab.gpu_power import PowerMeter


class FakeNvml:
    """NVML's four calls the meter makes: energy rises 700 mJ per read, the clock is capped."""

    def __init__(self, sm_mhz: int, reasons: int) -> None:
        self.energy_mj, self.sm_mhz, self.reasons = 0, sm_mhz, reasons

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, out) -> int:
        self.energy_mj += 700
        out._obj.value = self.energy_mj
        return 0

    def nvmlDeviceGetClockInfo(self, handle, clock_type, out) -> int:
        out._obj.value = self.sm_mhz
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, out) -> int:
        out._obj.value = self.reasons
        return 0


def test_the_meter_reads_joules_watts_clock_and_how_often_the_power_cap_held():
    meter = PowerMeter(FakeNvml(sm_mhz=1500, reasons=0x4 | 0x1), ctypes.c_void_p())
    with meter:
        time.sleep(0.1)  # a few clock samples
    reading = meter.reading()
    assert reading["joules"] == 0.7  # one read at each end
    assert 0 < reading["watts"] < 7  # 0.7 J over a bit more than 0.1 s
    assert reading["sm_mhz"] == 1500 and reading["power_capped"] == 1.0


def test_a_clock_that_is_not_capped_reads_zero_and_cpu_has_no_meter():
    meter = PowerMeter(FakeNvml(sm_mhz=1980, reasons=0), ctypes.c_void_p())
    with meter:
        pass  # shorter than a sample: the reading takes one itself
    assert meter.reading()["power_capped"] == 0.0 and meter.reading()["sm_mhz"] == 1980
    assert PowerMeter.for_device(torch.device("cpu")) is None
