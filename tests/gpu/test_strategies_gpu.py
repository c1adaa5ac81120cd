"""Every strategy on 2 GPUs with NCCL gives DDP's losses and weights (issues 3 and 4, on GPU).

    python3 -m pytest tests/gpu/test_strategies_gpu.py     # on a machine with 2+ GPUs

Skipped without two CUDA devices. fp32 weights, so the tolerance only absorbs NCCL's
reduction order (looser than the gloo tests' 1e-5). The memory variant also checkpoints two of
the three blocks and offloads what the first two save over real CUDA side streams and pinned
buffers.
"""

import pytest
import torch

from litegen.config.strategies import names_where
from tests.distributed.harness import run_ranks
from tests.distributed.runs import CHECKPOINT_AND_OFFLOAD, full_weights, train_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

STEPS = 20


def train(strategy: str, accum: int, offload: bool = False) -> dict:
    optimization = {"parallel": {"strategy": strategy}}
    if offload:
        optimization["memory"] = CHECKPOINT_AND_OFFLOAD
    gen, model, losses = train_tiny(
        {
            "runtime": {"device": "cuda"},
            "max_steps": STEPS,
            "trainer": {"grad_accum_steps": accum},
            "optimization": optimization,
        }
    )
    offloader = gen.models[0].memory.offloader
    stats = offloader.stats if offloader is not None else None
    came_back = (
        stats.tensors_prefetched + stats.tensors_fetched_on_demand + stats.tensors_reused_on_device
        if stats
        else 0
    )
    return {
        "losses": losses,
        "state": full_weights(gen, model),
        "offloaded": stats.tensors_offloaded if stats else 0,
        "came_back": came_back,
        "reloaded": stats.bytes_reloaded if stats else 0,
    }


def assert_same_run(result: dict, reference: dict) -> None:
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-4, atol=1e-5)
    for name, value in reference["state"].items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-4, atol=1e-5)


# (strategy, grad_accum_steps, checkpointing + offload) of every run the tests compare.
# Every strategy of the table that runs on one node, against ddp.
ONE_NODE = names_where(lambda row: row.min_nodes == 1)
SHARDING = [s for s in ONE_NODE if s != "ddp"]
RUNS = [("ddp", 1, False), ("ddp", 2, False)]
RUNS += [(s, accum, False) for s in SHARDING for accum in (1, 2)]
RUNS += [(s, 2, True) for s in ONE_NODE]


def train_all() -> dict:
    """Every run of ``RUNS`` in one pair of spawned ranks (spawning costs more than training)."""
    return {run: train(*run) for run in RUNS}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_ranks(train_all, 2, start_method="spawn", timeout_s=600)[0]


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy", SHARDING)
def test_strategy_matches_ddp_over_nccl(results, strategy, accum):
    assert_same_run(results[strategy, accum, False], results["ddp", accum, False])


@pytest.mark.parametrize("strategy", ONE_NODE)
def test_checkpointing_with_offload_matches_plain_ddp_over_nccl(results, strategy):
    result = results[strategy, 2, True]
    assert result["offloaded"] > 0 and result["came_back"] == result["offloaded"], result
    assert result["reloaded"] > 0, result  # some copies made the round trip through the host
    assert_same_run(result, results["ddp", 2, False])
