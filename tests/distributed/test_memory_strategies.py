"""Activation checkpointing and CPU offload under every sharding strategy (gloo, CPU ranks).

Recomputation and offloaded copies must not change the numbers: losses and final weights
with checkpointing + offload (a block without checkpointing offloading everything it saves, a
checkpointed one its inputs) equal those without, strategy by strategy.
"""

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.runs import CHECKPOINT_AND_OFFLOAD, full_weights, train_tiny

pytestmark = pytest.mark.slow


def train(strategy: str, memory: dict) -> dict:
    gen, model, losses = train_tiny(
        {
            "max_steps": 6,
            "trainer": {"grad_accum_steps": 2},
            "optimization": {"parallel": {"strategy": strategy}, "memory": memory},
        }
    )
    report = gen.models[0].memory
    stats = report.offloader.stats if report.offloader else None
    return {
        "losses": losses,
        "state": full_weights(gen, model),
        "checkpointed": len(report.checkpointed),
        "offloaded": stats.tensors_offloaded if stats else 0,
        "came_back": stats.tensors_prefetched
        + stats.tensors_fetched_on_demand
        + stats.tensors_reused_on_device
        if stats
        else 0,
    }


@pytest.mark.parametrize(
    ("strategy", "world", "nodes"),
    [
        ("ddp", 2, 1),
        ("zero1", 2, 1),
        ("zero2", 2, 1),
        ("fsdp1", 2, 1),
        ("fsdp2", 2, 1),
        ("hsdp", 4, 2),
    ],
)
def test_checkpointing_and_offload_change_nothing(strategy, world, nodes):
    local = world // nodes
    plain = run_ranks(train, world, strategy, {}, local_world_size=local)[0]
    saved = run_ranks(train, world, strategy, CHECKPOINT_AND_OFFLOAD, local_world_size=local)[0]
    assert len(plain["losses"]) == 6
    assert (plain["checkpointed"], plain["offloaded"]) == (0, 0)
    assert saved["checkpointed"] == 2 and saved["offloaded"] > 0
    assert saved["came_back"] == saved["offloaded"]  # each copy served its backward once
    torch.testing.assert_close(saved["losses"], plain["losses"], rtol=1e-6, atol=1e-7)
    for name, value in plain["state"].items():
        torch.testing.assert_close(saved["state"][name], value, rtol=1e-6, atol=1e-7)
