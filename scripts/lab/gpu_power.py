"""A GPU's energy, power and SM clock over a stretch of work, read from NVML, for benchmarks.

An H200 running a DiT step at full speed draws its 700 W power limit: the driver then lowers the
SM clock until the draw fits, and a step takes as long as its energy takes at 700 W. So two
machine starts can differ by several percent at the same code, with the GPU that draws more per
clock (silicon, temperature) running slower, and a kernel that is faster but spends the same
energy gains nothing there. ``scripts/bench/bench_dit.py`` prints what this meter reads for
each side's timed steps: joules per step, mean watts, mean SM clock and how often the power cap held the clock
down. NVML is the driver's ``libnvidia-ml``, reached through ctypes (no Python package needed).

    python3 -m scripts.lab.gpu_power     # two seconds of a bf16 GEMM loop on GPU 0, metered

Example:
    >>> meter = PowerMeter.for_device(torch.device("cuda", 0))  # None without NVML
    >>> with meter:
    ...     run_steps()
    >>> meter.reading()  # doctest: +SKIP
    {'seconds': 0.6, 'joules': 412.3, 'watts': 688.1, 'sm_mhz': 1532.0, 'power_capped': 0.93}
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

import torch

_NVML_CLOCK_SM = 1
_SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap: the driver holds clocks under the limit
_SAMPLE_S = 0.02


class PowerMeter:
    """Energy (NVML's counter) and SM clock samples (a thread) between ``__enter__`` and exit."""

    def __init__(self, nvml: ctypes.CDLL, handle: ctypes.c_void_p) -> None:
        self._nvml, self._handle = nvml, handle
        # Renamed in CUDA 12.2's NVML; drivers keep the old name too.
        new_name = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = new_name or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self._samples: list[tuple[int, bool]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = self._end = (0, 0.0)

    @classmethod
    def for_device(cls, device: torch.device) -> PowerMeter | None:
        """A meter for a CUDA device, or ``None`` off CUDA or where NVML cannot read energy."""
        if device.type != "cuda":
            return None
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() != 0:
                return None
            handle = ctypes.c_void_p()
            index = torch.cuda._get_nvml_device_index(device)  # CUDA_VISIBLE_DEVICES applied
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                return None
            meter = cls(nvml, handle)
            meter._energy_mj()  # GPUs before Volta have no energy counter
            return meter
        except (OSError, RuntimeError, AttributeError):
            return None

    def _energy_mj(self) -> int:
        energy = ctypes.c_ulonglong()
        status = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(energy))
        if status != 0:
            raise RuntimeError(f"nvmlDeviceGetTotalEnergyConsumption failed with status {status}")
        return energy.value

    def _sample(self) -> tuple[int, bool]:
        clock, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
        self._nvml.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(clock))
        self._reasons(self._handle, ctypes.byref(reasons))
        return clock.value, bool(reasons.value & _SW_POWER_CAP)

    def _poll(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self._samples.append(self._sample())

    def __enter__(self) -> PowerMeter:
        self._samples.clear()
        self._stop.clear()
        self._start = (self._energy_mj(), time.perf_counter())
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._end = (self._energy_mj(), time.perf_counter())
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def reading(self) -> dict[str, float]:
        """Seconds, joules and mean watts of the block, mean SM MHz and the power-capped share."""
        samples = self._samples or [self._sample()]
        joules = (self._end[0] - self._start[0]) / 1e3
        seconds = self._end[1] - self._start[1]
        return {
            "seconds": seconds,
            "joules": joules,
            "watts": joules / seconds if seconds > 0 else 0.0,
            "sm_mhz": sum(clock for clock, _ in samples) / len(samples),
            "power_capped": sum(capped for _, capped in samples) / len(samples),
        }


def sustained(
    fn: Callable[[], object], meter: PowerMeter, seconds: float = 2.0, settle_s: float = 0.5
) -> dict[str, float]:
    """``fn()`` called back to back for ``seconds`` after ``settle_s`` of the same, metered.

    Loaded long enough, the GPU reaches the clock its power limit allows (the settling part),
    so the figures are those of a training run rather than of a cold burst: milliseconds and
    millijoules per call added to :meth:`PowerMeter.reading`.
    """
    deadline = time.perf_counter() + settle_s
    while time.perf_counter() < deadline:
        fn()
        torch.cuda.synchronize()
    calls = 0
    with meter:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
    reading = meter.reading()
    return reading | {"ms": reading["seconds"] / calls * 1e3, "mj": reading["joules"] / calls * 1e3}


def main() -> None:
    device = torch.device("cuda", 0)
    meter = PowerMeter.for_device(device)
    if meter is None:
        raise SystemExit("needs a CUDA GPU whose driver's NVML reads energy")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    reading = sustained(lambda: a @ a, meter)
    print(
        f"bf16 GEMMs of 8192^3: {reading['ms']:.3f} ms and {reading['mj']:.0f} mJ a call, "
        f"{reading['watts']:.0f} W, {reading['sm_mhz']:.0f} MHz SM clock, power-capped "
        f"{100 * reading['power_capped']:.0f}% of samples, "
        f"{2 * 8192**3 / 1e12 / (reading['mj'] / 1e3):.2f} TFLOP/J"
    )


if __name__ == "__main__":
    main()
