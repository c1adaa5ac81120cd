"""FLOP counting on CUDA with inductor: the counting step costs a compiled step's memory."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from litegen.compile import compile_blocks
from litegen.flops.throughput import FlopCounter
from litegen.utils.config import CompileConfig
from tests.gpu.nets import BATCH, HIDDEN, TOKENS, Block
from tests.gpu.peaks import peak_since, start_peak

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEPTH = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cond = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.SiLU())
        self.blocks = nn.ModuleList(Block("tanh") for _ in range(DEPTH))
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cond = self.cond(x.mean(1))
        for block in self.blocks:
            x = block(x, cond=cond)
        return self.head(x).square().mean()


def first_step(compiled: bool, count: bool):
    """Peak memory of a fresh model's first step above what was allocated before it."""
    torch.manual_seed(0)
    net = Net().cuda()
    if compiled:
        compile_blocks(net, CompileConfig(enabled=True))
    x = torch.randn(BATCH, TOKENS, HIDDEN, device="cuda")
    before = start_peak()
    with FlopCounter() if count else nullcontext() as counter:
        loss = net(x)
        loss.backward()
    peak = peak_since(before)
    grads = {name: p.grad.detach().clone() for name, p in net.named_parameters()}
    flops = counter.flops if counter is not None else None
    del net, x, loss
    return peak, flops, grads


def test_counting_step_peaks_like_a_compiled_step_and_counts_like_eager():
    torch._dynamo.reset()
    eager_peak, eager_flops, _ = first_step(compiled=False, count=True)
    compiled_peak, _, compiled_grads = first_step(compiled=True, count=False)
    counting_peak, flops, counting_grads = first_step(compiled=True, count=True)
    torch._dynamo.reset()
    print(
        f"peak MiB: eager {eager_peak / 2**20:.0f}, compiled {compiled_peak / 2**20:.0f}, "
        f"counting {counting_peak / 2**20:.0f}; FLOPs eager {eager_flops}, counted {flops}"
    )
    assert eager_peak > 1.05 * compiled_peak  # else this model could not show the difference
    assert counting_peak <= 1.05 * compiled_peak
    assert flops == pytest.approx(eager_flops, rel=0.01)
    for name, grad in compiled_grads.items():
        torch.testing.assert_close(counting_grads[name], grad, msg=name)
