"""A tiny adaLN transformer and helpers shared by the memory tests (checkpointing, offload)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from litegen.utils.config import MemoryConfig

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
