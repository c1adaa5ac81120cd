"""On one GPU: block swap streams frozen weights from pinned memory on a side stream (same
gradients as without it, a lower peak), FP8 base weights, and torchao FP8 linear training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litegen.config import LoRAConfig
from litegen.lora import apply_lora
from litegen.memory import BlockSwap
from litegen.precision.fp8_training import apply_fp8_training, fp8_unavailable
from litegen.precision.fp8_weights import store_frozen_linears_in_fp8
from tests.gpu.peaks import peak_since, start_peak

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HIDDEN, DEPTH, TOKENS = 1024, 8, 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def lora_net(fp8: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    apply_lora(net, LoRAConfig(rank=16, target_modules=["up", "down"]))
    for name, p in net.named_parameters():  # non-zero B, so every adapter has a gradient
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    if fp8:
        store_frozen_linears_in_fp8(net, fp8)
    return net.cuda()


def step(net: nn.Module) -> tuple[dict, int]:
    x = torch.randn(
        2, TOKENS, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    base = start_peak()
    net(x).square().mean().backward()
    peak = peak_since(base)
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}
    return grads, peak


@pytest.mark.parametrize("fp8", [None, "rowwise"])
def test_block_swap_on_cuda_gives_the_same_gradients_from_less_memory(fp8):
    reference = lora_net(fp8)
    want, _ = step(reference)
    before = torch.cuda.memory_allocated()
    net = lora_net(fp8)
    on_device = torch.cuda.memory_allocated() - before  # the whole second net
    swap = BlockSwap(net, blocks_on_device=2, device=torch.device("cuda"))
    swap.to_host()
    # The frozen weights of all but two blocks left the device.
    moved = sum(
        p.numel() * p.element_size()
        for block in net.blocks[2:]
        for p in block.parameters()
        if not p.requires_grad
    )
    assert moved > 0
    assert torch.cuda.memory_allocated() - before <= on_device - moved
    got, _ = step(net)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert swap.stats.prefetched > 0
    frozen = [p for p in net.blocks[-1].parameters() if not p.requires_grad]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in frozen)


FP8_READY = torch.cuda.is_available() and fp8_unavailable(torch.device("cuda")) is None


@pytest.mark.skipif(not FP8_READY, reason="needs FP8 matmuls (8.9+) and torchao")
def test_fp8_linear_training_converts_and_tracks_bf16():
    torch.manual_seed(0)
    net = Net().cuda().to(torch.bfloat16)
    reference = Net().cuda().to(torch.bfloat16)
    reference.load_state_dict(net.state_dict())
    assert apply_fp8_training(net, "rowwise", torch.device("cuda")) == 2 * DEPTH
    x = torch.randn(4, TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    out, want = net(x), reference(x)
    assert (out - want).norm() / want.norm() < 0.1
    out.float().square().mean().backward()
