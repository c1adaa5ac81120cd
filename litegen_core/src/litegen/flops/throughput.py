"""FLOPs per training step, peak FLOP/s of known GPUs, and the throughput metrics built on them.

MFU (model FLOPs utilisation) is the FLOPs a step needs divided by what the GPU could do in the
step's time: ``flops_per_step_per_gpu / step_seconds / peak_flops``.

FLOPs per step come from the model when it says (``flops_per_sample()``: training FLOPs of one
sample, forward and backward) or are counted by :class:`FlopCounter` (``FlopCounterMode``) on the
first training step's forward and backward (with ``selective_ratio: auto``, the second step: the
first runs extra forwards to measure the blocks). Counting sees every matmul and attention op
that runs, including frozen encoders in ``train_step`` and, with activation checkpointing, the
recomputed forward, so then the figure is hardware FLOPs utilisation; give
``flops_per_sample()`` for strict model FLOPs.

Counting runs compiled regions compiled (:mod:`litegen.flops.counting`).

Peak FLOP/s: ``trainer.peak_tflops`` when set, else :data:`PEAK_TFLOPS` by device name (dense
bf16). For H200 we use 790 TFLOP/s, the bf16 matmul rate measured on our H200s, not the 989 of
the datasheet, so the MFU we log is the one the targets are stated in. On CPU, or a GPU not in
the table, MFU is left out unless ``trainer.peak_tflops`` is set.

Example::

    counter = FlopCounter()
    with counter:
        model(x).sum().backward()
    mfu(counter.flops, step_seconds=0.5, peak=peak_flops("cuda"))
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from litegen.flops.counting import FlopCounter


@dataclass(frozen=True)
class Peak:
    """Dense bf16 tensor-core throughput of one GPU, in TFLOP/s."""

    datasheet: float
    used: float  # what MFU divides by (the datasheet value unless we measured)
    source: str


# Matched against torch.cuda.get_device_name() in order, so longer names come first.
PEAK_TFLOPS: dict[str, Peak] = {
    "H200": Peak(989.0, 790.0, "measured bf16 matmul peak on our H200s; datasheet 989"),
    "H100 PCIe": Peak(756.0, 756.0, "datasheet"),
    "H100": Peak(989.0, 989.0, "datasheet (SXM)"),
    "H800": Peak(989.0, 989.0, "datasheet"),
    "H20": Peak(148.0, 148.0, "datasheet"),
    "A100": Peak(312.0, 312.0, "datasheet"),
    "A800": Peak(312.0, 312.0, "datasheet"),
    "L40S": Peak(362.0, 362.0, "datasheet"),
    "L4": Peak(121.0, 121.0, "datasheet"),
    "A10G": Peak(70.0, 70.0, "datasheet"),
}


def peak_flops(device: torch.device | str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s used for MFU on ``device``; ``None`` when unknown (CPU, GPUs not listed).

    Example:
        >>> peak_flops("cpu", override_tflops=1.5)
        1500000000000.0
    """
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"trainer.peak_tflops={override_tflops} must be positive (TFLOP/s).")
        return override_tflops * 1e12
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_TFLOPS.items():
        if key in name:
            return peak.used * 1e12
    return None


def model_flops_per_sample(model: nn.Module | None) -> float | None:
    """The model's own ``flops_per_sample()`` (forward + backward of one sample), if it has one."""
    fn = getattr(model, "flops_per_sample", None)
    return float(fn()) if callable(fn) else None


def model_tokens_per_sample(model: nn.Module | None, configured: int | None = None) -> int | None:
    """Tokens per sample: ``trainer.tokens_per_sample``, else the model's ``tokens_per_sample``."""
    if configured is not None:
        return configured
    value = getattr(model, "tokens_per_sample", None)
    value = value() if callable(value) else value
    return int(value) if value is not None else None


def mfu(flops_per_step: float, step_seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of one GPU: ``flops_per_step / step_seconds / peak`` (0..1).

    Example:
        >>> mfu(4e14, step_seconds=1.0, peak=8e14)
        0.5
    """
    if peak is None or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / peak


def throughput(
    *,
    steps: int,
    seconds: float,
    samples_per_step: int,
    world_size: int,
    tokens_per_sample: int | None = None,
    flops_per_step_per_gpu: float | None = None,
    peak: float | None = None,
) -> dict[str, float]:
    """The throughput metrics the trainer logs for ``steps`` optimizer steps in ``seconds``.

    ``samples_per_step`` is the global batch; per-GPU figures divide by ``world_size``.

    Example:
        >>> throughput(steps=10, seconds=2.0, samples_per_step=8, world_size=2,
        ...            tokens_per_sample=256, flops_per_step_per_gpu=1e12, peak=1e13)
        {'samples_per_s': 40.0, 'tokens_per_s': 10240.0, 'tokens_per_s_per_gpu': 5120.0, 'mfu': 0.5}
    """
    out: dict[str, float] = {}
    if seconds <= 0 or steps <= 0:
        return out
    out["samples_per_s"] = steps * samples_per_step / seconds
    if tokens_per_sample is not None:
        out["tokens_per_s"] = out["samples_per_s"] * tokens_per_sample
        out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / world_size
    if flops_per_step_per_gpu is not None:
        value = mfu(flops_per_step_per_gpu, seconds / steps, peak)
        if value is not None:
            out["mfu"] = value
    return out


class StepThroughput:
    """What the trainer needs: count FLOPs once, then turn (steps, seconds) into metrics.

    FLOPs are counted only when a peak is known (else MFU could not be reported anyway), on the
    first micro-batch ``count()`` wraps; ``accum`` micro-batches make one optimizer step.

    Example::

        meter = StepThroughput(model, device=gen.device, world_size=2, samples_per_step=256)
        with meter.count():
            train_step(batch).backward()
        meter.metrics(steps=10, seconds=4.0)["mfu"]
    """

    def __init__(
        self,
        model: nn.Module | None,
        *,
        device: torch.device | str,
        world_size: int,
        samples_per_step: int,
        accum: int = 1,
        peak_tflops: float | None = None,
        tokens_per_sample: int | None = None,
    ) -> None:
        self.world_size = world_size
        self.samples_per_step = samples_per_step
        self.accum = accum
        self.peak = peak_flops(device, peak_tflops)
        self.tokens_per_sample = model_tokens_per_sample(model, tokens_per_sample)
        per_sample = model_flops_per_sample(model)
        self.flops_per_step_per_gpu = (
            per_sample * samples_per_step / world_size if per_sample is not None else None
        )
        self._pending = self.peak is not None and self.flops_per_step_per_gpu is None

    @property
    def counting(self) -> bool:
        """Whether the next :meth:`count` counts (else it is a no-op context)."""
        return self._pending

    def count(self) -> AbstractContextManager:
        """A FLOP counter around the first micro-batch that needs one; otherwise nothing."""
        return self._count() if self._pending else nullcontext()

    @contextmanager
    def _count(self) -> Iterator[None]:
        self._pending = False
        with FlopCounter() as counter:
            yield
        if counter.flops is not None:
            self.flops_per_step_per_gpu = counter.flops * self.accum

    def metrics(self, steps: int, seconds: float) -> dict[str, float]:
        """samples/s, tokens/s (total and per GPU) and MFU, as far as they are known."""
        return throughput(
            steps=steps,
            seconds=seconds,
            samples_per_step=self.samples_per_step,
            world_size=self.world_size,
            tokens_per_sample=self.tokens_per_sample,
            flops_per_step_per_gpu=self.flops_per_step_per_gpu,
            peak=self.peak,
        )


__all__ = [
    "PEAK_TFLOPS",
    "FlopCounter",
    "Peak",
    "StepThroughput",
    "mfu",
    "model_flops_per_sample",
    "model_tokens_per_sample",
    "peak_flops",
    "throughput",
]
