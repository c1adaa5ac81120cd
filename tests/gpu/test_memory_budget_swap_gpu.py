"""``selective_ratio: auto`` with block swap and FP8 base weights on CUDA: the planned steps peak
within the budget, and the plan's estimate is close to their measured peak.

The budget sits between the estimates of every block checkpointed and none, so the plan leaves
some blocks out; the swapped blocks' weights stream in both modes and count in the phases.
"""

from __future__ import annotations

import gc

import pytest
import torch

from litegen.config import LoRAConfig, MemoryConfig
from litegen.lora import apply_lora
from litegen.memory import BlockSwap, apply_memory_optimizations
from litegen.precision.fp8_weights import store_frozen_linears_in_fp8
from tests.gpu.nets import WideStack
from tests.gpu.peaks import peak_since, start_peak

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEPTH, WIDTH, ROWS, ON_DEVICE = 8, 2048, 4096, 2
# The estimate may differ from the measured peak by this share of the activations the plan
# chose between (every block's, left out) and by the allocator's small temporaries.
TOLERANCE = 0.1
SLACK = 64 * 2**20


def train(budget_bytes: float) -> tuple[int, object, int]:
    """Peak allocated over steps 2-3 (absolute), the chosen plan and block swap's fetches.

    Nothing of the run stays allocated after it, so every run starts from the same memory.
    """
    torch.manual_seed(0)
    model = WideStack(DEPTH, WIDTH)
    apply_lora(model, LoRAConfig(rank=8, alpha=16, target_modules=["up", "down"]))
    store_frozen_linears_in_fp8(model, "rowwise")
    model.cuda()
    device = torch.device("cuda")
    swap = BlockSwap(model, ON_DEVICE, device)
    ac = {"enabled": True, "selective_ratio": "auto", "memory_budget_gib": budget_bytes / 2**30}
    memory = MemoryConfig.model_validate({"activation_checkpoint": ac})
    report = apply_memory_optimizations(model, memory, device=device)
    swap.to_host()
    assert swap.swapped
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randn(ROWS, WIDTH, device=device)
    start = 0
    for step in range(3):
        if step == 1:
            start = start_peak()
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = start + peak_since(start)
    plan, fetches = report.planner.plan, swap.stats.fetches
    del model, optimizer, x, report, swap  # the swap's forwards and the model form cycles
    gc.collect()
    return peak, plan, fetches


def test_auto_with_block_swap_and_fp8_bases_fits_and_estimates_its_peak():
    ones = torch.ones(8, 8, device="cuda")
    ones @ ones  # cuBLAS's workspace, allocated by the first matmul, stays out of the peaks
    _, all_in, _ = train(1)  # nothing fits: the smallest estimate
    _, all_out, _ = train(2**44)  # everything fits: no block checkpointed
    assert all_out.checkpointed == ()
    spread = all_out.estimate_bytes - all_in.estimate_bytes  # what leaving every block out adds
    budget = all_in.estimate_bytes + 0.5 * spread
    peak, plan, fetches = train(budget)
    print(
        f"budget {budget / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB, estimate "
        f"{plan.estimate_bytes / 2**20:.0f} MiB, {len(plan.checkpointed)} of {DEPTH} "
        f"checkpointed, {fetches} fetches"
    )
    assert 0 < len(plan.checkpointed) < DEPTH and fetches > 0
    assert plan.estimate_bytes <= budget
    assert peak <= budget
    assert abs(plan.estimate_bytes - peak) <= TOLERANCE * spread + SLACK
