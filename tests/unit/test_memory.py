"""Activation checkpointing and offload on CPU: recompute counted in FLOPs, results exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from litegen.config import MemoryConfig, OptimizationConfig
from litegen.memory import (
    ActivationOffloader,
    apply_memory_optimizations,
    checkpoint_modules,
    is_checkpointed,
    select_evenly,
)
from litegen.parallel import ParallelPlan, build_strategy
from tests.distributed.harness import run_ranks

HIDDEN, TOKENS, BATCH = 16, 6, 3


class Block(nn.Module):
    """adaLN block: conditioning by keyword, a tuple out (tokens, an auxiliary scalar)."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ada = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(
            nn.Linear(HIDDEN, 4 * HIDDEN),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * HIDDEN, HIDDEN),
        )
        self.seen: list[int] | None = None  # data_ptr of every input x, when a test asks

    def forward(self, x: torch.Tensor, *, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.seen is not None:
            self.seen.append(x.data_ptr())
        shift, scale = self.ada(F.silu(cond)).unsqueeze(1).chunk(2, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        b, t, c = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(a)
        x = x + self.mlp(self.norm(x))
        return x, a.square().mean()


class Net(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, a = block(x, cond=cond)
            aux = aux + a
        return self.head(x).square().mean() + aux


def make_net(depth: int = 4) -> Net:
    torch.manual_seed(0)
    return Net(depth)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, TOKENS, HIDDEN, generator=gen)
    return x, torch.randn(BATCH, HIDDEN, generator=gen)


def memory_cfg(ratio: float = 0.0, offload: bool = False, **ac) -> MemoryConfig:
    return MemoryConfig.model_validate(
        {
            "activation_checkpoint": {"enabled": True, "selective_ratio": ratio, **ac},
            "activation_offload": offload,
        }
    )


def loss_and_grads(model: nn.Module, *batches) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = sum(model(*b) for b in batches)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_exact(actual, expected) -> None:
    assert torch.equal(actual[0], expected[0])
    assert actual[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        assert torch.equal(actual[1][name], grad), name


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
# ops recomputes no matmul and ops_lean only mlp.0, the one that widens its input 4x.
@pytest.mark.parametrize(
    ("policy", "extra_per_block"),
    [("ops", 0), ("ops_lean", 2 * BATCH * TOKENS * HIDDEN * 4 * HIDDEN)],
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
    with pytest.raises(ValueError, match="policy memory_budget checkpoints none"):
        apply_memory_optimizations(make_net(), memory_cfg(0.0, True, policy="memory_budget"))


@pytest.mark.parametrize(
    "cfg",
    [
        memory_cfg(0.0),
        memory_cfg(0.5),
        memory_cfg(0.0, policy="ops"),
        memory_cfg(0.0, policy="ops_lean"),
        memory_cfg(0.0, offload=True),
        memory_cfg(0.5, offload=True, policy="ops"),
    ],
    ids=["full", "half", "ops", "ops_lean", "offload", "half-ops-offload"],
)
def test_losses_and_gradients_are_exactly_unchanged(cfg):
    expected = loss_and_grads(make_net(), batch())
    model = make_net()
    apply_memory_optimizations(model, cfg)
    assert_exact(loss_and_grads(model, batch()), expected)
    assert_exact(loss_and_grads(model, batch()), expected)  # second step: pooled buffers reused


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


# -- offload -----------------------------------------------------------------------------------
def test_offload_counts_moves_and_reuses_the_block_inputs():
    model = make_net()
    report = apply_memory_optimizations(model, memory_cfg(0.5, offload=True))
    stats = report.offloader.stats
    loss_and_grads(model, batch())
    # Each checkpointed call saves x and the keyword cond: 2 blocks x 2 tensors.
    per_call = (BATCH * TOKENS * HIDDEN + BATCH * HIDDEN) * 4
    assert (stats.tensors_offloaded, stats.bytes_offloaded) == (4, 2 * per_call)
    assert stats.tensors_kept == 0
    # The last block of forward is needed at once; the other is prefetched while it runs.
    assert (stats.tensors_fetched_on_demand, stats.tensors_prefetched) == (2, 2)
    assert stats.bytes_reloaded == stats.bytes_offloaded
    assert (stats.buffers_allocated, stats.buffers_reused) == (4, 0)
    loss_and_grads(model, batch())
    assert (stats.buffers_allocated, stats.buffers_reused) == (4, 4)  # the pool serves step 2


@pytest.mark.parametrize("offload", [False, True])
def test_recompute_reads_the_offloaded_copy(offload):
    model = make_net()
    apply_memory_optimizations(model, memory_cfg(0.0, offload=offload))
    block = model.blocks[2]
    block.seen = []
    x, cond = batch()
    keep = []  # hold the forward inputs so their memory cannot be handed to the copies
    block.register_forward_pre_hook(lambda m, args, kwargs: keep.append(args[0]), with_kwargs=True)
    loss = model(x, cond)
    loss.backward()
    forward_ptr, recompute_ptr = block.seen
    assert (forward_ptr != recompute_ptr) == offload


def test_two_forwards_before_one_backward_each_get_their_own_chain():
    batches = [batch(1), batch(2)]
    expected = loss_and_grads(make_net(), *batches)
    model = make_net()
    report = apply_memory_optimizations(model, memory_cfg(0.0, offload=True))
    assert_exact(loss_and_grads(model, *batches), expected)
    stats = report.offloader.stats
    assert stats.tensors_offloaded == 2 * 4 * 2
    # One on-demand fetch per forward (its last block); everything else came prefetched.
    assert (stats.tensors_fetched_on_demand, stats.tensors_prefetched) == (4, 12)


def test_gradient_accumulation_under_offload_matches_plain():
    def accumulate(model):
        model.zero_grad(set_to_none=True)
        model(*batch(1)).backward()
        model(*batch(2)).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    expected = accumulate(make_net())
    model = make_net()
    apply_memory_optimizations(model, memory_cfg(0.25, offload=True))
    for name, grad in accumulate(model).items():
        assert torch.equal(grad, expected[name]), name


def test_offload_without_checkpointing_raises_with_the_fix():
    cfg = MemoryConfig.model_validate({"activation_offload": True})
    with pytest.raises(ValueError, match="enabled: true"):
        apply_memory_optimizations(make_net(), cfg)
    with pytest.raises(ValueError, match="selective_ratio below 1"):
        apply_memory_optimizations(make_net(), memory_cfg(1.0, offload=True))


def test_offloader_keeps_parameters_and_honours_min_bytes():
    offloader = ActivationOffloader(min_bytes=BATCH * HIDDEN * 4 + 1)  # cond is too small
    model = make_net()
    checkpoint_modules(model, ["blocks.0"], offloader=offloader)
    loss_and_grads(model, batch())
    assert (offloader.stats.tensors_offloaded, offloader.stats.tensors_kept) == (1, 1)


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
