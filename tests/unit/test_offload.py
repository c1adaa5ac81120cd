"""Activation offload on CPU: what moves, what stays, what comes back; results exact.

On CPU the offloader runs its CUDA bookkeeping with synchronous copies: device tensors are held
"in flight" for ``blocks_in_flight`` blocks, earlier ones are dropped and brought back from the
host copies, so the counts below are those of a GPU run.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.autograd.graph import saved_tensors_hooks

from litegen.compile import compile_blocks
from litegen.memory import ActivationOffloader, apply_memory_optimizations, checkpoint_modules
from litegen.memory.offload import BLOCKS_IN_FLIGHT, _dense_strides
from litegen.utils.config import CompileConfig, MemoryConfig
from tests.unit.memory_nets import (
    BATCH,
    HIDDEN,
    TOKENS,
    assert_exact,
    batch,
    loss_and_grads,
    make_net,
    memory_cfg,
)

X_BYTES = BATCH * TOKENS * HIDDEN * 4  # a block's input tokens
COND_BYTES = BATCH * HIDDEN * 4  # the conditioning every block receives


def offloaded_net(cfg: MemoryConfig, depth: int = 4, **offloader):
    model = make_net(depth)
    report = apply_memory_optimizations(model, cfg)
    report.offloader.min_bytes = 0  # the tiny net's tensors are all below the default
    for name, value in offloader.items():
        setattr(report.offloader, name, value)
    return model, report


def came_back(stats) -> int:
    return (
        stats.tensors_prefetched + stats.tensors_fetched_on_demand + stats.tensors_reused_on_device
    )


def test_checkpointed_blocks_offload_their_inputs_and_the_last_block_keeps_its_own():
    model, report = offloaded_net(memory_cfg(0.0, offload=True), blocks_in_flight=2)
    assert report.offloaded == ["blocks.0", "blocks.1", "blocks.2"]  # blocks.3 is backward's first
    assert_exact(loss_and_grads(model, batch()), loss_and_grads(make_net(), batch()))
    stats = report.offloader.stats
    # x of blocks 0-2, and cond once: blocks 1 and 2 share block 0's copy.
    assert (stats.tensors_offloaded, stats.tensors_shared) == (4, 2)
    assert stats.bytes_offloaded == 3 * X_BYTES + COND_BYTES
    assert (stats.tensors_kept, stats.tensors_over_limit) == (0, 0)
    # Blocks 1 and 2 were in flight when backward began (2 blocks): used where they were.
    # Block 0's x and the shared cond came back while block 2 ran its backward.
    assert stats.tensors_reused_on_device == 2
    assert (stats.tensors_prefetched, stats.tensors_fetched_on_demand) == (2, 0)
    assert stats.bytes_reloaded == X_BYTES + COND_BYTES


def is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def saved_by_blocks(depth: int, blocks: int) -> list[torch.Tensor]:
    """Every tensor the first ``blocks`` blocks of a plain net save, recorded independently."""
    model, saved = make_net(depth), []
    for block in model.blocks[:blocks]:
        forward = block.forward

        def recorded(*args, forward=forward, **kwargs):
            with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                return forward(*args, **kwargs)

        block.forward = recorded
    model(*batch())
    return saved


def stays(t: torch.Tensor) -> bool:
    """Parameters, and views with gaps (q, k, v sliced out of one qkv projection)."""
    return is_parameter(t) or not _dense_strides(t)


def test_plain_blocks_offload_everything_they_save_but_parameters_and_gapped_views():
    model, report = offloaded_net(MemoryConfig(activation_offload=True))
    assert report.checkpointed == [] and len(report.offloaded) == 3
    assert_exact(loss_and_grads(model, batch()), loss_and_grads(make_net(), batch()))

    saved = saved_by_blocks(4, 3)
    kept = [t for t in saved if stays(t)]
    activations = {id(t): t for t in saved if not stays(t)}
    assert any(map(is_parameter, kept)) and activations  # Linear saves weight.t()
    assert not all(map(is_parameter, kept))  # attention saves q, k, v: views with gaps
    stats = report.offloader.stats
    assert stats.tensors_kept == len(kept)
    assert stats.tensors_offloaded == len(activations)
    assert stats.tensors_shared == len(saved) - len(kept) - len(activations)
    assert stats.bytes_offloaded == sum(t.numel() * t.element_size() for t in activations.values())
    assert came_back(stats) == stats.tensors_offloaded


@pytest.mark.parametrize(("in_flight", "reused_blocks"), [(1, [4]), (2, [3, 4]), (3, [2, 3, 4])])
def test_only_the_last_blocks_in_flight_are_still_on_the_device(in_flight, reused_blocks):
    model, report = offloaded_net(MemoryConfig(activation_offload=True), depth=6)
    assert report.offloader.blocks_in_flight == BLOCKS_IN_FLIGHT
    report.offloader.blocks_in_flight = in_flight
    loss_and_grads(model, batch())
    per_block = sum(not stays(t) for t in saved_by_blocks(6, 1))  # none shared
    stats = report.offloader.stats
    assert stats.tensors_shared == 0 and stats.tensors_offloaded == 5 * per_block
    assert stats.tensors_reused_on_device == len(reused_blocks) * per_block
    assert came_back(stats) == stats.tensors_offloaded


@pytest.mark.parametrize(
    ("block", "offload", "moved"), [(0, False, False), (0, True, True), (2, True, False)]
)
def test_recompute_reads_the_host_copy_unless_still_in_flight(block, offload, moved):
    model = make_net(depth=6)  # blocks 2-4 are the last three in flight
    apply_memory_optimizations(model, memory_cfg(0.0, offload=offload))
    model.blocks[block].seen = []
    keep = []  # hold the forward inputs so their memory cannot be handed to the copies
    model.blocks[block].register_forward_pre_hook(
        lambda m, args, kwargs: keep.append(args[0]), with_kwargs=True
    )
    model(*batch()).backward()
    forward_ptr, recompute_ptr = model.blocks[block].seen
    assert (forward_ptr != recompute_ptr) == moved


def test_two_forwards_before_one_backward_each_get_their_own_chain():
    batches = [batch(1), batch(2)]
    expected = loss_and_grads(make_net(), *batches)
    model, report = offloaded_net(memory_cfg(0.0, offload=True))
    assert_exact(loss_and_grads(model, *batches), expected)
    stats = report.offloader.stats
    assert (stats.tensors_offloaded, stats.tensors_shared) == (2 * 4, 2 * 2)
    assert came_back(stats) == stats.tensors_offloaded


def test_gradient_accumulation_under_offload_matches_plain():
    def accumulate(model):
        model.zero_grad(set_to_none=True)
        model(*batch(1)).backward()
        model(*batch(2)).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    expected = accumulate(make_net())
    model, _ = offloaded_net(memory_cfg(0.25, offload=True))
    for name, grad in accumulate(model).items():
        assert torch.equal(grad, expected[name]), name


def test_offloader_keeps_parameters_and_honours_min_bytes():
    offloader = ActivationOffloader(min_bytes=COND_BYTES + 1)  # cond is too small
    model = make_net()
    checkpoint_modules(model, ["blocks.0"], offloader=offloader)
    loss_and_grads(model, batch())
    assert (offloader.stats.tensors_offloaded, offloader.stats.tensors_kept) == (1, 1)


def test_the_pinned_limit_keeps_the_rest_on_the_device_and_is_released():
    # Host copies count at the caching host allocator's rounding only when pinned (CUDA).
    model, report = offloaded_net(memory_cfg(0.0, offload=True), max_pinned_bytes=2 * X_BYTES)
    assert_exact(loss_and_grads(model, batch()), loss_and_grads(make_net(), batch()))
    stats = report.offloader.stats
    assert stats.tensors_offloaded == 2 and stats.tensors_over_limit == 2  # x2 and cond stay
    gc.collect()
    assert report.offloader.host_bytes == 0


@pytest.mark.parametrize(
    ("ratio", "inside"),
    [(0.0, True), (0.0, False), (0.5, True), (None, True)],
    ids=["full-inside-compile", "full-outside-compile", "half-inside-compile", "no-checkpoint"],
)
def test_offload_sees_what_compiled_blocks_save(ratio, inside):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graph breaks that earlier tests compiled
    if ratio is None:
        cfg = MemoryConfig(activation_offload=True)
    else:
        cfg = memory_cfg(ratio, offload=True, inside_compile=inside)
    model, report = offloaded_net(cfg)
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(model, CompileConfig(enabled=True), backend=counter)
    loss, grads = loss_and_grads(model, batch())
    ref_loss, ref_grads = loss_and_grads(make_net(), batch())
    torch.testing.assert_close(loss, ref_loss)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    assert not torch._dynamo.utils.counters["graph_break"]  # the hooks stay outside the graphs
    assert 1 <= counter.frame_count <= 2  # one graph per mode the blocks run in
    stats = report.offloader.stats
    assert stats.tensors_offloaded > 0
    # A compiled block saves its parameters themselves, which stay; an eager checkpoint around
    # a compiled block saves only the block's inputs.
    assert (stats.tensors_kept > 0) == (inside or ratio != 0.0)
    assert came_back(stats) == stats.tensors_offloaded
    torch._dynamo.reset()
