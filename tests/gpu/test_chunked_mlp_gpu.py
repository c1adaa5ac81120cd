"""Chunked GELU MLPs on CUDA: the same gradients as the plain MLP in bf16, and a working set
of one chunk (skipped without a GPU).

    python3 -m pytest -q -s tests/gpu/test_chunked_mlp_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from litegen.memory.mlp_token_chunks import apply_chunked_mlp
from tests.gpu.peaks import peak_since, start_peak

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WIDTH, HIDDEN, TOKENS, CHUNK = 1024, 4096, 32768, 4096
MIB = 2**20


def mlp() -> nn.Sequential:
    layers = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU("tanh"), nn.Linear(HIDDEN, WIDTH))
    return layers.cuda()


def step_peak(model: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Peak bytes a forward and backward add above what was allocated before; the gradients."""
    x = x.detach().requires_grad_()
    base = start_peak()
    with torch.autocast("cuda", torch.bfloat16):
        y = model(x)
    y.float().square().mean().backward()
    peak = peak_since(base)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return peak, y.detach(), grads


def test_chunked_mlp_matches_the_plain_one_within_a_fraction_of_its_memory():
    torch.manual_seed(0)
    plain = mlp()
    chunked = copy.deepcopy(plain)
    assert apply_chunked_mlp(chunked, CHUNK) == 1
    x = torch.randn(TOKENS, WIDTH, device="cuda")
    for model in (plain, chunked):  # cuBLAS handles and workspaces, outside the measurement
        step_peak(model, x)
    plain_peak, plain_y, plain_grads = step_peak(plain, x)
    chunked_peak, chunked_y, chunked_grads = step_peak(chunked, x)
    print(
        f"\nforward + backward peak: plain {plain_peak / MIB:.0f} MiB, "
        f"chunked ({TOKENS // CHUNK} chunks) {chunked_peak / MIB:.0f} MiB"
    )
    torch.testing.assert_close(chunked_y.float(), plain_y.float(), rtol=2e-2, atol=2e-2)
    for got, expected in zip(chunked_grads, plain_grads, strict=True):
        torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-3)
    # The plain MLP holds its bf16 pre-activation and GELU output (2 x 256 MiB) and makes their
    # gradients in backward; chunked, each is an eighth of that.
    hidden_bytes = TOKENS * HIDDEN * 2
    assert plain_peak > 2 * hidden_bytes
    assert chunked_peak < plain_peak - 1.5 * hidden_bytes
