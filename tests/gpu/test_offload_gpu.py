"""Activation offload on CUDA: saved activations leave the GPU, gradients stay the same."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litegen.memory import apply_memory_optimizations
from litegen.utils.config import MemoryConfig
from tests.gpu.nets import BATCH, HIDDEN, TOKENS, Block
from tests.gpu.peaks import peak_since, start_peak

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEPTH = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cond=cond)
        return self.head(x).square().mean()


def run(offload: bool, checkpoint: bool) -> tuple[int, dict[str, torch.Tensor], object]:
    """Peak memory of one step above what was allocated before it, grads, offload stats."""
    torch.manual_seed(0)
    model = Net().cuda()
    memory = MemoryConfig.model_validate(
        {
            "activation_checkpoint": {"enabled": checkpoint, "selective_ratio": 0.0},
            "activation_offload": offload,
        }
    )
    offloader = apply_memory_optimizations(model, memory).offloader
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(BATCH, TOKENS, HIDDEN, device="cuda", generator=gen)
    cond = torch.randn(BATCH, HIDDEN, device="cuda", generator=gen)
    model(x, cond).backward()  # warm-up: allocator caches, pinned buffers, streams
    model.zero_grad(set_to_none=False)
    if offloader is not None:
        offloader.stats.reset()
    before = start_peak()
    model(x, cond).backward()
    peak = peak_since(before)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return peak, grads, offloader.stats if offloader else None


@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpointed", "not-checkpointed"])
def test_offload_lowers_peak_by_most_of_the_offloaded_bytes_with_the_same_gradients(checkpoint):
    plain_peak, plain_grads, _ = run(offload=False, checkpoint=checkpoint)
    peak, grads, stats = run(offload=True, checkpoint=checkpoint)
    x_bytes = BATCH * TOKENS * HIDDEN * 4
    # Every block but the last offloads: checkpointed, its input x (cond once, shared by all);
    # otherwise everything it saves but its parameters.
    assert stats.bytes_offloaded >= (DEPTH - 1) * x_bytes
    if checkpoint:
        assert (stats.tensors_offloaded, stats.tensors_shared) == (DEPTH, DEPTH - 2)
    came_back = (
        stats.tensors_prefetched + stats.tensors_fetched_on_demand + stats.tensors_reused_on_device
    )
    assert came_back == stats.tensors_offloaded and stats.tensors_prefetched > 0
    saved = plain_peak - peak
    print(
        f"peak {plain_peak / 2**20:.0f} -> {peak / 2**20:.0f} MiB, "
        f"offloaded {stats.bytes_offloaded / 2**20:.0f} MiB"
    )
    # The last blocks' copies may still be in flight when backward starts; the rest is gone.
    assert saved >= 0.6 * stats.bytes_offloaded
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
