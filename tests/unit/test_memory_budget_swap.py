"""``selective_ratio: auto`` with block swap and FP8 base weights on a CPU 'device'.

The planner's counting run sees the swapped blocks' weights as parameters (not activations), so
it chooses the plan it chooses without block swap; training under that plan gives the losses and
adapter gradients of the same run with the plan fixed, and measuring moves no extra weights.
"""

from __future__ import annotations

import logging

import pytest
import torch

from litegen.config import LoRAConfig, MemoryConfig
from litegen.lora import apply_lora
from litegen.memory import BlockSwap, apply_memory_optimizations
from litegen.precision.fp8_weights import store_frozen_linears_in_fp8
from tests.distributed.models import PairDataset, loss_fn, make_model

CPU = torch.device("cpu")
STEPS = 3
DEPTH = 3


def auto(budget_bytes: float) -> dict:
    return {"enabled": True, "selective_ratio": "auto", "memory_budget_gib": budget_bytes / 2**30}


def fixed(paths: list[str]) -> dict:
    return {"enabled": True, "selective_ratio": 0.0, "target_paths": paths}


def train(checkpoint: dict, swap: bool = False, fp8: bool = False) -> dict:
    model = make_model()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=["mlp.0", "mlp.2", "ada"]))
    if fp8:
        store_frozen_linears_in_fp8(model, "rowwise")
    block_swap = BlockSwap(model, 1, CPU) if swap else None
    memory = MemoryConfig.model_validate({"activation_checkpoint": checkpoint})
    report = apply_memory_optimizations(model, memory, device=CPU)
    if block_swap is not None:
        block_swap.to_host()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for batch in torch.utils.data.DataLoader(PairDataset(8 * STEPS), batch_size=8):
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
    plan = report.planner.plan if report.planner is not None else None
    return {"losses": losses, "grads": grads, "report": report, "plan": plan, "swap": block_swap}


@pytest.fixture(scope="module")
def budget() -> float:
    """Room for two of the three blocks' activations (of similar size), measured without swap."""
    all_in = train(auto(1))["plan"].estimate_bytes  # nothing fits: the smallest estimate
    all_out = train(auto(2**40))["plan"].estimate_bytes
    return all_in + 0.75 * (all_out - all_in)


@pytest.mark.parametrize(("swap", "fp8"), [(True, False), (False, True), (True, True)])
def test_auto_plans_as_without_the_swap_and_trains_as_its_fixed_plan(swap, fp8, budget, caplog):
    without = train(auto(budget), fp8=fp8)
    with caplog.at_level(logging.INFO, logger="litegen"):
        planned = train(auto(budget), swap=swap, fp8=fp8)
    chosen = planned["report"].checkpointed
    assert len(chosen) == 1  # one block recomputes, two keep their activations
    assert chosen == list(planned["plan"].checkpointed)
    # Swapped weights are parameters of the counting run, not activations it saves.
    assert planned["plan"] == without["plan"]
    assert f"{len(chosen)} of {DEPTH} blocks checkpointed" in caplog.text
    assert ", ".join(chosen) in planned["report"].describe()

    reference = train(fixed(chosen), swap=swap, fp8=fp8)
    assert reference["report"].checkpointed == chosen
    assert planned["losses"] == reference["losses"]
    for got, want in zip(planned["grads"], reference["grads"], strict=True):
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    if swap:  # a swapped block keeps its activations; measuring fetched nothing twice
        assert set(planned["swap"].swapped) - set(chosen)
        assert planned["swap"].stats == reference["swap"].stats
