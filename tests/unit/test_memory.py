"""Activation checkpointing on CPU: recompute counted in FLOPs, results exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from litegen.config import MemoryConfig, OptimizationConfig
from litegen.memory import (
    apply_memory_optimizations,
    block_forward,
    is_checkpointed,
    select_evenly,
)
from litegen.parallel import ParallelPlan, build_strategy
from tests.distributed.harness import run_ranks
from tests.unit.memory_nets import (
    BATCH,
    HIDDEN,
    TOKENS,
    Net,
    assert_exact,
    batch,
    loss_and_grads,
    make_net,
    memory_cfg,
)


# -- selection ---------------------------------------------------------------------------------
def test_selective_ratio_spreads_checkpointed_blocks_evenly():
    blocks = [f"b.{i}" for i in range(4)]
    assert select_evenly(blocks, 0.0) == blocks
    assert select_evenly(blocks, 0.5) == ["b.1", "b.3"]
    assert select_evenly(blocks, 0.25) == ["b.1", "b.2", "b.3"]
    assert select_evenly(blocks, 1.0) == []
    deep = select_evenly([f"b.{i}" for i in range(28)], 0.25)
    assert len(deep) == 21 and "b.0" not in deep and "b.4" not in deep and "b.27" in deep
    with pytest.raises(ValueError, match="selective_ratio"):
        select_evenly(blocks, 1.5)


@pytest.mark.parametrize(("ratio", "expected"), [(0.0, [0, 1, 2, 3]), (0.5, [1, 3]), (1.0, [])])
def test_backward_flops_rise_by_exactly_the_recomputed_blocks(ratio, expected):
    x, cond = batch()
    plain = make_net()
    tokens = plain.embed(x)
    with FlopCounterMode(display=False) as block_fwd:
        plain.blocks[0](tokens, cond=cond)
    loss = plain(x, cond)
    with FlopCounterMode(display=False) as plain_bwd:
        loss.backward()

    model = make_net()
    report = apply_memory_optimizations(model, memory_cfg(ratio))
    assert report.checkpointed == [f"blocks.{i}" for i in expected]
    assert [is_checkpointed(b) for b in model.blocks] == [i in expected for i in range(4)]
    loss = model(x, cond)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    per_block = block_fwd.get_total_flops()
    assert per_block > 0
    assert bwd.get_total_flops() == plain_bwd.get_total_flops() + len(expected) * per_block


# Extra backward FLOPs per block. Of ada (2x wider), qkv (3x), proj, mlp.0 (4x) and mlp.2,
# ops_all recomputes no matmul and ops only mlp.0, the one that widens its input 4x.
@pytest.mark.parametrize(
    ("policy", "extra_per_block"),
    [("ops_all", 0), ("ops", 2 * BATCH * TOKENS * HIDDEN * 4 * HIDDEN)],
)
def test_op_policies_recompute_exactly_their_matmuls(policy, extra_per_block):
    x, cond = batch()
    plain, model = make_net(), make_net()
    apply_memory_optimizations(model, memory_cfg(0.0, policy=policy))
    counts = []
    for m in (plain, model):
        loss = m(x, cond)
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
        counts.append(bwd.get_total_flops())
    assert counts[1] == counts[0] + len(model.blocks) * extra_per_block


def test_memory_budget_policy_leaves_the_blocks_to_compile():
    model = make_net()
    report = apply_memory_optimizations(
        model, memory_cfg(0.0, policy="memory_budget", memory_budget=0.3)
    )
    assert report.memory_budget == 0.3 and report.checkpointed == []
    assert not any(is_checkpointed(b) for b in model.blocks)
    assert "memory_budget, 0.3" in report.describe()
    # With offload, the blocks run plainly and hand what they save to the offloader.
    model = make_net()
    report = apply_memory_optimizations(model, memory_cfg(0.0, True, policy="memory_budget"))
    assert report.checkpointed == [] and report.offloaded == ["blocks.0", "blocks.1", "blocks.2"]
    assert [block_forward(b) is not None for b in model.blocks] == [True, True, True, False]
    assert not any(is_checkpointed(b) for b in model.blocks)


@pytest.mark.parametrize(
    "cfg",
    [
        memory_cfg(0.0),
        memory_cfg(0.5),
        memory_cfg(0.0, policy="ops"),
        memory_cfg(0.0, policy="ops_all"),
        memory_cfg(0.0, offload=True),
        memory_cfg(0.5, offload=True, policy="ops"),
        MemoryConfig(activation_offload=True),
    ],
    ids=["full", "half", "ops", "ops_all", "offload", "half-ops-offload", "offload-only"],
)
def test_losses_and_gradients_are_exactly_unchanged(cfg):
    expected = loss_and_grads(make_net(), batch())
    model = make_net()
    apply_memory_optimizations(model, cfg)
    assert_exact(loss_and_grads(model, batch()), expected)
    assert_exact(loss_and_grads(model, batch()), expected)  # a second step, as the first


def test_state_dict_and_parameter_names_are_unchanged():
    plain, model = make_net(), make_net()
    apply_memory_optimizations(model, memory_cfg(0.0, offload=True))
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    model.load_state_dict(plain.state_dict())  # strict: a plain checkpoint loads as is
    assert "forward" not in plain.blocks[0].__dict__ and is_checkpointed(model.blocks[0])


def test_inference_runs_without_checkpoint_or_offload():
    model = make_net()
    report = apply_memory_optimizations(model, memory_cfg(0.0, offload=True))
    with torch.no_grad():
        assert torch.equal(model(*batch()), make_net()(*batch()))
    assert report.offloader.stats.tensors_offloaded == 0


# -- candidates --------------------------------------------------------------------------------
class Listed(Net):
    def get_fsdp_wrap_module_list(self) -> list[nn.Module]:
        return [self.blocks[0].mlp, self.blocks[3]]


def test_candidates_come_from_get_fsdp_wrap_module_list():
    model = Listed()
    report = apply_memory_optimizations(model, memory_cfg(0.0))
    assert report.checkpointed == ["blocks.0.mlp", "blocks.3"]
    assert is_checkpointed(model.blocks[0].mlp) and not is_checkpointed(model.blocks[1])
    model(*batch()).backward()


def test_target_paths_win_and_are_checked():
    report = apply_memory_optimizations(make_net(), memory_cfg(0.0, target_paths=["blocks.2"]))
    assert report.checkpointed == ["blocks.2"]
    with pytest.raises(ValueError, match="not submodules"):
        apply_memory_optimizations(make_net(), memory_cfg(0.0, target_paths=["block.2"]))
    with pytest.raises(ValueError, match="nested"):
        apply_memory_optimizations(
            make_net(), memory_cfg(0.0, target_paths=["blocks.1", "blocks.1.mlp"])
        )


def test_fsdp2_candidates_are_the_planned_sharding_units():
    plan = ParallelPlan(
        "fsdp2", torch.device("cpu"), world_size=1, rank=0, nnodes=1, local_world_size=1
    )
    model = make_net()
    candidates = build_strategy(plan, OptimizationConfig()).checkpoint_candidates(model)
    report = apply_memory_optimizations(model, memory_cfg(0.5), candidates=candidates)
    assert report.candidates == [f"blocks.{i}" for i in range(4)]
    assert report.checkpointed == ["blocks.1", "blocks.3"]


def test_disabled_checkpointing_touches_nothing():
    model = make_net()
    report = apply_memory_optimizations(model, MemoryConfig())
    assert report.checkpointed == [] and not any(is_checkpointed(b) for b in model.blocks)


# -- through prepare, 2 DDP ranks ---------------------------------------------------------------
def ddp_losses(checkpoint: bool) -> dict:
    import litegen
    from litegen.utils.config import MainConfig

    ac = {"enabled": True, "selective_ratio": 0.5}
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "global_batch_size": 2,
            "optimization": {
                "parallel": {"strategy": "ddp"},
                "profiles": {"ckpt": {"memory": {"activation_checkpoint": ac}}}
                if checkpoint
                else {},
            },
        }
    )
    gen = litegen.initialize(config)
    model, aux = make_net(), make_net(depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = gen.prepare(model, optimizer, profile="ckpt" if checkpoint else None)
    aux = gen.prepare(aux)  # general settings: no checkpointing for this one
    losses = []
    for step in range(3):
        loss = model(*batch(10 * step + gen.rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    flags = [is_checkpointed(b) for b in gen.unwrap(model).blocks]
    return {
        "losses": losses,
        "flags": flags,
        "aux": [is_checkpointed(b) for b in aux.module.blocks],
    }


@pytest.mark.slow
def test_two_ddp_ranks_with_checkpointing_match_without():
    plain = run_ranks(ddp_losses, 2, False)
    ckpt = run_ranks(ddp_losses, 2, True)
    for rank in range(2):
        assert ckpt[rank]["losses"] == plain[rank]["losses"]
        assert ckpt[rank]["flags"] == [False, True, False, True]
        assert plain[rank]["flags"] == [False] * 4
        assert ckpt[rank]["aux"] == [False, False]
