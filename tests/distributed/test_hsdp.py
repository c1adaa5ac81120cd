"""HSDP on a simulated 2-node launch: 4 gloo ranks, LOCAL_WORLD_SIZE=2 (2 nodes x 2 procs)."""

from __future__ import annotations

import pytest
import torch

from litegen.config.sections import ParallelConfig
from litegen.parallel.plan import ParallelPlan
from litegen.runtime.distributed import DistEnv
from tests.distributed.harness import run_ranks
from tests.distributed.test_fsdp import (
    STEPS,
    assert_same_optim,
    assert_same_weights,
    checkpoint_round_trips,
    grad_checks,
    public,
    train,
)


def hsdp_suite(tmp: str) -> dict:
    """DDP and HSDP runs on the same ranks, the HSDP layout, and checkpoint round trips."""
    out: dict = {}
    for accum in (1, 2):
        out["ddp", accum] = public(train("ddp", tmp, accum))
        result = train("hsdp", tmp, accum)
        out["hsdp", accum] = public(result)
    weight = result["model"].blocks[0].mlp[0].weight
    out["mesh"] = (tuple(weight.device_mesh.shape), weight.device_mesh.mesh_dim_names)
    out["placements"] = [repr(p) for p in weight.placements]
    out["local_shard"] = weight.to_local().detach().clone()
    out["ckpt"] = checkpoint_round_trips(result, f"{tmp}/hsdp")
    out["grads"] = grad_checks("hsdp", tmp)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("hsdp"))
    return run_ranks(hsdp_suite, 4, tmp, local_world_size=2)


def test_hsdp_refuses_a_single_node_run():
    one_node = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, launched=True)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        ParallelPlan.build("hsdp", ParallelConfig(strategy="hsdp"), one_node, torch.device("cpu"))


@pytest.mark.slow
def test_hsdp_shards_within_a_node_and_replicates_across_nodes(four_ranks):
    assert four_ranks[0]["mesh"] == ((2, 2), ("replicate", "shard"))
    assert four_ranks[0]["placements"] == ["Replicate()", "Shard(dim=0)"]
    shards = [r["local_shard"] for r in four_ranks]  # ranks 0, 1 on node 0; 2, 3 on node 1
    torch.testing.assert_close(shards[0], shards[2], rtol=0, atol=0)
    torch.testing.assert_close(shards[1], shards[3], rtol=0, atol=0)
    assert (
        shards[0].shape[0] * 2
        == four_ranks[0]["hsdp", 1]["state"]["blocks.0.mlp.0.weight"].shape[0]
    )
    assert not torch.equal(shards[0], shards[1])


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_hsdp_matches_ddp(four_ranks, accum):
    ddp, got = four_ranks[0]["ddp", accum], four_ranks[0]["hsdp", accum]
    assert len(got["losses"]) == STEPS
    torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-5, atol=1e-6)
    assert_same_weights(got["state"], ddp["state"], rtol=1e-5, atol=1e-6)
    assert got["groups_after_prepare"] == got["groups_before"]
    assert got["param_types"] == ["DTensor"]


@pytest.mark.slow
def test_hsdp_checkpoints_round_trip(four_ranks):
    trained, ckpt = four_ranks[0]["hsdp", 2]["state"], four_ranks[0]["ckpt"]  # the last run
    assert ckpt["file_keys"] == sorted(trained)
    assert_same_weights(ckpt["file_loaded"], trained, rtol=0, atol=0)
    assert_same_weights(ckpt["dcp_loaded"], trained, rtol=0, atol=0)
    assert_same_optim(ckpt["dcp_optim"], ckpt["saved_optim"])


@pytest.mark.slow
def test_hsdp_clip_grad_norm_and_no_sync(four_ranks):
    got = four_ranks[0]["grads"]
    assert got["norm"] == pytest.approx(2 * got["expected"], rel=1e-5)
    assert got["clipped"] == pytest.approx(got["expected"], rel=1e-4)
    assert not any(got["grads_after_no_sync"])
