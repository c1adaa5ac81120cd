"""``selective_ratio: auto`` on CUDA: the plan's estimate follows the step's phases.

Blocks with large weights and small activations peak at the end of backward, when every gradient
exists and the blocks' activations are gone. Leaving blocks unchecked adds to the forward's
peak only, so a budget just above the unchecked step's own peak must leave every block unchecked.
"""

from __future__ import annotations

import pytest
import torch

from litegen.memory import apply_memory_optimizations
from litegen.utils.config import MemoryConfig
from tests.gpu.nets import WideStack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEPTH, WIDTH, ROWS = 8, 2048, 1024


def train(memory: dict | None) -> tuple[int, object]:
    """Peak allocated over steps 2-3 (above what was allocated before the model), the report."""
    torch.manual_seed(0)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    model = WideStack(DEPTH, WIDTH).cuda()
    report = None
    if memory is not None:
        report = apply_memory_optimizations(model, MemoryConfig.model_validate(memory))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(ROWS, WIDTH, device="cuda")
    for step in range(3):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, report


def test_auto_leaves_every_block_unchecked_when_the_end_of_backward_sets_the_peak():
    ones = torch.ones(8, 8, device="cuda")
    ones @ ones  # cuBLAS's workspace, allocated by the first matmul, stays out of both peaks
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    plain_peak, _ = train(None)
    budget_gib = (start + 1.02 * plain_peak) / 2**30
    ac = {"enabled": True, "selective_ratio": "auto", "memory_budget_gib": budget_gib}
    peak, report = train({"activation_checkpoint": ac})
    plan = report.planner.plan
    print(
        f"unchecked peak {plain_peak / 2**20:.0f} MiB, auto {peak / 2**20:.0f} MiB, "
        f"estimate {(plan.estimate_bytes - start) / 2**20:.0f} MiB, "
        f"{len(plan.checkpointed)} of {DEPTH} checkpointed"
    )
    assert plan.checkpointed == ()
    assert plan.estimate_bytes <= budget_gib * 2**30
    # The estimate covers the step it planned (within the allocator's small temporaries).
    assert start + peak <= plan.estimate_bytes + 16 * 2**20
