"""One process of ``bench_memory_real.py``: Wan 2.1 1.3B built, prepared for a variant, trained.

The variants (hand-written loops and LiteGen's checkpointing and offload settings), and the two
measurements a child process makes: :func:`time_variant` (warm-up and timed steps) and
:func:`probe` (whether one step at a length fits a memory cap). ``bench_memory_real.py`` starts
one process per measurement and passes its options as JSON:

    python3 -m scripts.bench.bench_memory_real --child '{"mode": "probe", "variant": "full", "frames": 11, ...}'
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class Variant:
    """One setting: hand-written (``hand``) or through LiteGen's library API (``memory``)."""

    label: str
    hand: bool = False
    hand_checkpoint: bool = False
    memory: dict[str, Any] = field(default_factory=dict)
    offload_inputs_only: bool = False  # offload's old scope: checkpointed blocks' inputs


def _ac(ratio: Any, **extra: Any) -> dict[str, Any]:
    return {"enabled": True, "selective_ratio": ratio, **extra}


VARIANTS: dict[str, Variant] = {
    "hand_none": Variant("hand-written, no checkpointing", hand=True),
    "hand_ckpt": Variant(
        "hand-written, every block checkpoint_wrapper(compiled)", hand=True, hand_checkpoint=True
    ),
    "none": Variant("LiteGen, no checkpointing"),
    "full": Variant("LiteGen, every block checkpointed", memory={"activation_checkpoint": _ac(0)}),
    "full_outside": Variant(
        "LiteGen, every block checkpointed, inside_compile false",
        memory={"activation_checkpoint": _ac(0, inside_compile=False)},
    ),
    "ops": Variant("LiteGen, policy ops", memory={"activation_checkpoint": _ac(0, policy="ops")}),
    "ops_all": Variant(
        "LiteGen, policy ops_all", memory={"activation_checkpoint": _ac(0, policy="ops_all")}
    ),
    "half": Variant("LiteGen, half the blocks", memory={"activation_checkpoint": _ac(0.5)}),
    "half_offload": Variant(
        "LiteGen, half the blocks + offload",
        memory={"activation_checkpoint": _ac(0.5), "activation_offload": True},
    ),
    "half_offload_inputs": Variant(
        "LiteGen, half the blocks + offload of their inputs only",
        memory={"activation_checkpoint": _ac(0.5)},
        offload_inputs_only=True,
    ),
    "full_offload": Variant(
        "LiteGen, every block checkpointed + offload",
        memory={"activation_checkpoint": _ac(0), "activation_offload": True},
    ),
    "auto": Variant(
        "LiteGen, selective_ratio auto (+ offload allowed)",
        memory={"activation_checkpoint": _ac("auto"), "activation_offload": True},
    ),
}
TABLE = [
    "hand_none",
    "hand_ckpt",
    "full",
    "full_outside",
    "ops",
    "ops_all",
    "half",
    "half_offload",
    "half_offload_inputs",
    "full_offload",
]
LONGEST = ["hand_none", "full", "full_offload"]


def _shape(opts: dict[str, Any], frames: int) -> Any:
    from litegen_zoo.real_models import LatentShape

    if opts["tiny"]:
        return LatentShape(4, 4, frames=frames, text_tokens=6)
    return LatentShape(60, 104, frames=frames, text_tokens=512)


def _prepare(model: Any, variant: Variant, opts: dict[str, Any], device: Any) -> Any:
    """Checkpointing, offload and regional compile for ``variant``; LiteGen's report or None."""
    import torch
    from torch import nn

    from litegen.compile import correct_gradient_options

    backend = opts["backend"]
    dynamic = opts["dynamic"]
    if variant.hand:
        options = correct_gradient_options() if backend == "inductor" else None
        for block in model.blocks:
            block.forward = torch.compile(
                block.forward, backend=backend, dynamic=dynamic, options=options
            )
        if variant.hand_checkpoint:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
        return None
    from litegen.compile import compile_blocks
    from litegen.memory import ActivationOffloader, apply_memory_optimizations, block_forward
    from litegen.utils.config import CompileConfig, MemoryConfig

    memory = dict(variant.memory, mlp_chunk_tokens=opts.get("mlp_chunk_tokens"))
    if variant.memory.get("activation_checkpoint", {}).get("selective_ratio") == "auto":
        ac = dict(memory["activation_checkpoint"], memory_budget_gib=opts["auto_budget_gib"])
        memory["activation_checkpoint"] = ac
    report = apply_memory_optimizations(model, MemoryConfig.model_validate(memory), device=device)
    if variant.offload_inputs_only:
        report.offloader = ActivationOffloader()
        for path in report.checkpointed:
            forward = block_forward(model.get_submodule(path))
            forward.offloader, forward.offload = report.offloader, True
        report.offloaded = list(report.checkpointed)
    if report.offloader is not None and opts.get("blocks_in_flight"):
        report.offloader.blocks_in_flight = opts["blocks_in_flight"]
    compile_blocks(
        model,
        CompileConfig(enabled=True, dynamic=dynamic),
        backend=None if backend == "inductor" else backend,
        memory_budget=report.memory_budget,
    )
    return report


def _setup(opts: dict[str, Any], frames: int, lr: float) -> tuple:
    import torch

    from litegen_zoo.real_models import REAL_MODELS

    device = torch.device(opts["device"])
    spec = REAL_MODELS["wan"]
    size = "tiny" if opts["tiny"] else "reference"
    with device:  # parameters made on the device: the 1.3B model builds in seconds
        model = spec.build(size)
    bf16_mixed = opts.get("precision") == "bf16-mixed"
    if bf16_mixed:
        model.to(torch.bfloat16)
    variant = VARIANTS[opts["variant"]]
    report = _prepare(model, variant, opts, device)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    if bf16_mixed:
        from litegen.optim import enable_master_weights

        enable_master_weights(optimizer)
    batch = spec.batch(size, batch_size=1, seed=0, shape=_shape(opts, frames))
    batch = {k: v.to(device) for k, v in batch.items()}
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    )

    def step() -> None:
        with autocast:
            loss = spec.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return device, model, optimizer, report, step


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_info(device: Any) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {"device_name": "cpu", "total_gib": None}
    props = torch.cuda.get_device_properties(device)
    return {"device_name": props.name, "total_gib": props.total_memory / GIB}


def time_variant(opts: dict[str, Any]) -> dict[str, Any]:
    """Warm-up and timed steps of one variant at ``opts["frames"]``."""
    import torch

    device, _, _, report, step = _setup(opts, opts["frames"], lr=1e-5)
    for _ in range(opts["warmup"]):  # compiles; the auto planner measures step 1
        step()
    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    offloader = report.offloader if report is not None else None
    if offloader is not None:
        offloader.stats.reset()
    times = []
    for _ in range(opts["steps"]):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    row: dict[str, Any] = {
        "variant": opts["variant"],
        "step_s": statistics.median(times),
        "step_times_s": times,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
        "resident_gib": torch.cuda.memory_allocated(device) / GIB if cuda else None,
        **_device_info(device),
    }
    if report is not None:
        row["checkpointed"] = len(report.checkpointed)
        row["offloaded_blocks"] = len(report.offloaded)
    if offloader is not None:
        row["offloaded_gib_per_step"] = offloader.stats.bytes_offloaded / opts["steps"] / GIB
        row["offload_stats"] = vars(offloader.stats)
    if report is not None and report.planner is not None and report.planner.plan is not None:
        plan = report.planner.plan
        row["auto_estimate_gib"] = plan.estimate_bytes / GIB
    return row


def probe(opts: dict[str, Any]) -> dict[str, Any]:
    """Whether one training step at ``opts["frames"]`` fits (``--memory-limit-gib``)."""
    import torch

    device = torch.device(opts["device"])
    limit = opts["memory_limit_gib"]
    if device.type == "cuda" and limit:
        total = torch.cuda.get_device_properties(device).total_memory
        # By index: torch 2.11 refuses a "cuda" device without one here.
        fraction = min(1.0, limit * GIB / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device.index or 0)
    row = {"variant": opts["variant"], "frames": opts["frames"], **_device_info(device)}
    try:
        device, model, optimizer, _, step = _setup(opts, opts["frames"], lr=0.0)
        for p in model.parameters():  # Adam's state first, so one step shows the true peak
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        step()
        _sync(device)
        row["step_s"] = time.perf_counter() - start
        row["fits"] = True
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
            row["resident_gib"] = resident / GIB
    except Exception as exc:  # out of memory, in any of its forms, means too long
        text = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in text.lower():
            raise
        row["fits"], row["reason"] = False, text.splitlines()[0][:600]
    return row
