"""Where a benchmark step's time goes: kernel time by category, and attention per SDPA backend.

The profiling half of ``bench_dit.py``, used through its flags (and ``bench_strategies.py``'s
``--profile``); it runs nothing on its own:

    torchrun --nproc_per_node=2 -m scripts.bench.bench_dit --workload A --strategy fsdp2 \
        --profile --attention-sweep
    torchrun --nproc_per_node=2 -m scripts.bench.bench_strategies --workload A --profile
    python -m scripts.bench.bench_dit --device cpu --tiny --profile --attention-sweep   # CPU smoke run

``--profile`` traces three more steps per side and splits a step's time by kernel category
(attention, GEMM, elementwise, optimizer, communication, exposed communication, idle).
``--attention-sweep`` times one attention call (forward and backward) per SDPA backend at the
workload's shape and names the kernel torch picks by default.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

from litegen.kernels.attention import BACKENDS, attention_context
from litegen_zoo.dit_model import DiTConfig
from scripts.lab.trace_kernels import kernel_category, load_kernels, union_us
from scripts.timing import ms_per_call, sync


def _time_attention(name: str, run, context, device: torch.device) -> dict:
    """Milliseconds per forward+backward call of ``run`` inside ``context`` (3 warm-up, 10 timed)."""
    try:
        with context:
            return {"backend": name, "ms": ms_per_call(run, device, calls=10)}
    except RuntimeError as exc:  # the backend does not support this shape or device
        return {"backend": name, "ms": None, "error": str(exc).splitlines()[0][:200]}


def attention_sweep(cfg: DiTConfig, tokens: int, batch: int, device: torch.device) -> list[dict]:
    """Forward+backward time of one attention call per backend, and torch's default kernel.

    Also cuDNN with q, k and v zero-padded to the next head dim that is a multiple of 32 and
    of 64 (the output is the same once sliced back, with the original softmax scale): whether
    padding an odd head dim (72) would pay.
    """
    import torch.nn.functional as F

    shape = (batch, cfg.heads, tokens, cfg.hidden // cfg.heads)
    q, k, v = (
        torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    head_dim = shape[-1]

    def run(padded: int = head_dim) -> None:
        qp, kp, vp = (
            F.pad(t, (0, padded - head_dim)) if padded > head_dim else t for t in (q, k, v)
        )
        out = F.scaled_dot_product_attention(qp, kp, vp, scale=head_dim**-0.5)
        out[..., :head_dim].sum().backward()

    rows = []
    for name in ("default", *BACKENDS):
        context = nullcontext() if name == "default" else attention_context(name, device)
        rows.append(_time_attention(name, run, context, device))
    for padded in sorted({-(-head_dim // 32) * 32, -(-head_dim // 64) * 64} - {head_dim}):
        context = attention_context("cudnn", device)
        rows.append(_time_attention(f"cudnn_pad{padded}", partial(run, padded), context, device))
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            sync(device)
        kernels = {
            e.key
            for e in prof.key_averages()
            if "attention" in e.key.lower() or "fmha" in e.key.lower() or "flash" in e.key.lower()
        }
        rows[0]["kernels"] = sorted(kernels)[:4]
    return rows


def profile_summary(
    runner,
    batch,
    device: torch.device,
    steps: int = 3,
    keep_trace: Path | None = None,
    host: bool = False,
) -> dict:
    """Where one step's time goes, from a CUDA kernel trace of ``steps`` steps (ms per step).

    Categories add kernel busy time (communication runs on its own stream, so it can overlap
    the rest); ``exposed_communication`` is communication time with no compute kernel running,
    and ``idle`` is step time with no kernel running at all (host overhead, waits). On CPU
    (smoke runs) the "kernels" are nested CPU ops, so the categories overcount.
    ``keep_trace`` also writes the trace there, gzipped, for a closer look (kernel by kernel,
    gaps on the timeline) in Perfetto or a script. ``host`` records the host's operators as well
    (what the CPU was doing in a gap), at some cost in launch time, so in ``idle``.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync(device)
    activities = [ProfilerActivity.CUDA] if cuda else []
    if host or not cuda:
        activities.append(ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            runner.step(batch)
        sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    with tempfile.TemporaryDirectory() as scratch:
        # torch gzips the trace itself when the name ends in .gz.
        trace = keep_trace if keep_trace is not None else Path(scratch) / "trace.json.gz"
        prof.export_chrome_trace(str(trace))
        kernels = load_kernels(trace, kind="kernel" if cuda else "cpu_op")
    busy: dict[str, float] = {}
    other: dict[str, float] = {}  # the uncategorised kernels, to see what compile left
    spans: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for e in kernels:
        category = kernel_category(e["name"])
        busy[category] = busy.get(category, 0.0) + e["dur"]
        if category == "elementwise/other":
            other[e["name"][:80]] = other.get(e["name"][:80], 0.0) + e["dur"]
        spans[category == "communication"].append((e["ts"], e["ts"] + e["dur"]))
    compute_us = union_us(spans[False])
    all_us = union_us(spans[False] + spans[True])
    summary = {name: us / steps / 1e3 for name, us in sorted(busy.items())}
    summary["exposed_communication"] = (all_us - compute_us) / steps / 1e3
    summary["idle"] = max(wall_us - all_us, 0.0) / steps / 1e3
    summary["step"] = wall_us / steps / 1e3
    top = sorted(other.items(), key=lambda item: -item[1])[:12]
    return summary | {"top_other_ms": {name: us / steps / 1e3 for name, us in top}}


def print_profiles(rows: list[dict]) -> None:
    """One line per profiled row: ms per step by kernel category."""
    for r in rows:
        if r.get("profile"):
            figures = {k: v for k, v in r["profile"].items() if isinstance(v, float)}
            parts = "  ".join(f"{k} {v:.1f}" for k, v in figures.items())
            print(f"profile {r['strategy']} {r['impl']} (ms/step): {parts}")
