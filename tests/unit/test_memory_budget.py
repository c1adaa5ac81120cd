"""``selective_ratio: auto``: the first step measures, the second runs the plan that fits.

On CPU the budget covers saved activations, which the blocks below make exactly known.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from litegen.compile import compile_blocks
from litegen.memory import apply_memory_optimizations, is_checkpointed
from litegen.memory.budget import BlockCost, candidate_choices, choose
from litegen.utils.config import CompileConfig, MemoryConfig
from tests.distributed.harness import run_ranks

ROWS, WIDTH, DEPTH = 8, 256, 4
X = ROWS * WIDTH * 4  # bytes of a block's input (fp32)
# Without checkpointing a block saves exp(x * w), its exp and dropout's scaled mask (fp32).
# With checkpointing it saves its input x, which no other block saves.
ACTIVATION = 3 * X
INPUT = X


class Costly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((WIDTH,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout((x * self.w).exp().exp(), p=0.25, training=True)  # RNG, as in training


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Costly() for _ in range(DEPTH))

    def get_fsdp_wrap_module_list(self) -> list[nn.Module]:
        return list(self.blocks)  # blocks without submodules are not detected on their own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def auto_cfg(budget_bytes: float, offload: bool = False) -> MemoryConfig:
    ac = {"enabled": True, "selective_ratio": "auto", "memory_budget_gib": budget_bytes / 2**30}
    return MemoryConfig.model_validate({"activation_checkpoint": ac, "activation_offload": offload})


def train(model: nn.Module, steps: int = 3) -> list[float]:
    torch.manual_seed(5)  # dropout's masks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(step))
        loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def make() -> Stack:
    torch.manual_seed(0)
    return Stack()


# Every block checkpointed saves the 4 inputs; each block left out adds its activations.
@pytest.mark.parametrize(
    ("budget", "checkpointed"),
    [
        (4 * INPUT + ACTIVATION, [1, 2, 3]),  # room for one block's activations
        (4 * INPUT + 2 * ACTIVATION + 100, [1, 3]),
        (4 * INPUT + 4 * ACTIVATION, []),
    ],
)
def test_auto_checkpoints_the_fewest_blocks_that_fit(budget, checkpointed, caplog):
    expected_losses = train(make())
    model = make()
    report = apply_memory_optimizations(model, auto_cfg(budget), device="cpu")
    assert "chosen on the first step" in report.describe()
    with caplog.at_level(logging.INFO, logger="litegen"):
        losses = train(model)
    assert losses == expected_losses  # measuring and switching change no number
    plan = report.planner.plan
    assert report.checkpointed == [f"blocks.{i}" for i in checkpointed]
    assert [is_checkpointed(b) for b in model.blocks] == [i in checkpointed for i in range(DEPTH)]
    assert plan.offloaded == () and report.offloaded == []
    assert plan.estimate_bytes == 4 * INPUT + (DEPTH - len(checkpointed)) * ACTIVATION
    assert plan.estimate_bytes <= budget < plan.estimate_bytes + ACTIVATION
    assert f"{len(checkpointed)} of {DEPTH} blocks checkpointed" in caplog.text


def test_until_the_first_optimizer_step_every_block_is_checkpointed():
    model = make()
    report = apply_memory_optimizations(model, auto_cfg(10 * 2**20), device="cpu")
    x = torch.randn(ROWS, WIDTH)
    for _ in range(2):  # two micro-batches of one step
        model(x).backward()
        assert all(is_checkpointed(b) for b in model.blocks) and report.planner.plan is None
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model(x).backward()
    assert report.planner.plan is not None and not any(is_checkpointed(b) for b in model.blocks)


def test_nothing_fits_runs_the_smallest_plan_and_warns(caplog):
    model = make()
    report = apply_memory_optimizations(model, auto_cfg(INPUT), device="cpu")
    with caplog.at_level(logging.WARNING, logger="litegen"):
        train(model)
    assert report.checkpointed == [f"blocks.{i}" for i in range(DEPTH)]
    assert "no plan fits" in caplog.text


def test_auto_on_cpu_needs_a_budget_in_gib():
    cfg = MemoryConfig.model_validate(
        {"activation_checkpoint": {"enabled": True, "selective_ratio": "auto"}}
    )
    with pytest.raises(ValueError, match="memory_budget_gib"):
        apply_memory_optimizations(make(), cfg, device="cpu")


def test_offload_plans_trade_recompute_for_copies_the_forward_hides():
    # 4 blocks of 100 activation bytes and 10 input bytes, 1 s per block forward.
    costs = {f"b.{i}": BlockCost(activation_bytes=100, input_bytes=10) for i in range(4)}

    def choose_within(budget: int, bandwidth: float):
        plans = candidate_choices(
            costs, {4: 1000}, 1.0, bandwidth, offload=True, blocks_in_flight=2
        )
        plan, fits = choose(plans, budget)
        assert fits
        return plan

    # Offloading every block but the last, with one checkpointed: 3 x 110 bytes leave, 2 blocks'
    # worth stay in flight: 1000 + 300 - 330 + 220.
    fast = choose_within(1250, bandwidth=1e9)
    assert (fast.checkpointed, fast.offloaded) == (("b.3",), ("b.0", "b.1", "b.2"))
    assert fast.estimate_bytes == 1190 and fast.cost_s == 1.0
    # Copies at 10 B/s take 33 s against a 4 s forward: two blocks recomputed cost less.
    slow = choose_within(1250, bandwidth=10.0)
    assert (slow.checkpointed, slow.offloaded) == (("b.1", "b.3"), ())
    # Only full checkpointing with offloaded inputs fits: 1000 - 30 + 20.
    tight = choose_within(995, bandwidth=1e9)
    assert (len(tight.checkpointed), tight.estimate_bytes) == (4, 990)


def test_blocks_left_out_add_only_to_the_phases_that_still_hold_them():
    # The forward peaks at 1000 (every block holds), block 2's backward at 1100 (blocks 0 and 1
    # still hold), the end of backward at 1250 (gradients, no block holds anything).
    costs = {f"b.{i}": BlockCost(activation_bytes=100, input_bytes=10) for i in range(4)}
    plans = candidate_choices(costs, {4: 1000, 2: 1100, 0: 1250}, 1.0, 0.0, offload=False)
    assert [p.estimate_bytes for p in plans] == [1400, 1300, 1250, 1250, 1250]
    # Two blocks left out fit under 1260, where one peak plus every activation (1450) would not.
    plan, fits = choose(plans, 1260)
    assert fits and plan.checkpointed == ("b.1", "b.3")


def ddp_auto(budget_gib: float) -> dict:
    import litegen
    from litegen.utils.config import MainConfig

    ac = {"enabled": True, "selective_ratio": "auto", "memory_budget_gib": budget_gib}
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "global_batch_size": 2,
            "optimization": {"memory": {"activation_checkpoint": ac}},
        }
    )
    gen = litegen.initialize(config)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = gen.prepare(model, optimizer)
    torch.manual_seed(gen.rank)
    rows = ROWS * (1 + gen.rank)  # the ranks measure different sizes and still agree
    for step in range(3):
        loss = model(torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"checkpointed": gen.models[0].memory.checkpointed}


@pytest.mark.slow
def test_ranks_plan_with_the_largest_figures_and_agree():
    # Room for two blocks' activations at rank 1's size (twice the rows), four at rank 0's.
    budget = (2 * 4 * INPUT + 2 * 2 * ACTIVATION + 100) / 2**30
    results = run_ranks(ddp_auto, 2, budget)
    assert results[0]["checkpointed"] == results[1]["checkpointed"] == ["blocks.1", "blocks.3"]


def test_auto_switches_compiled_blocks_between_one_graph_per_mode():
    torch._dynamo.reset()
    expected = train(make())
    model = make()
    report = apply_memory_optimizations(model, auto_cfg(4 * INPUT + 2 * ACTIVATION), device="cpu")
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(model, CompileConfig(enabled=True), backend=counter)
    torch.testing.assert_close(train(model), expected)
    # The counting run and the plain blocks share the plain graph, the rest the checkpointed one.
    assert report.planner.plan.estimate_bytes <= 4 * INPUT + 2 * ACTIVATION
    assert 0 < len(report.checkpointed) < DEPTH
    assert counter.frame_count == 2
    torch._dynamo.reset()
