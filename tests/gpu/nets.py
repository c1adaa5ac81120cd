"""The models the GPU tests train: a DiT-style block (adaLN-scaled attention and an MLP), and a
stack of wide residual MLPs whose activations dwarf their weights (the budget planner's tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, TOKENS, BATCH = 256, 2048, 8


class Block(nn.Module):
    """Attention over 4 heads and a 4x MLP, both after a norm scaled by ``cond``."""

    def __init__(self, gelu: str = "none") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(
            nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(approximate=gelu), nn.Linear(4 * HIDDEN, HIDDEN)
        )

    def forward(self, x: torch.Tensor, *, cond: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm(x) * (1 + cond.unsqueeze(1))
        q, k, v = self.qkv(h).view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm(x))


class Wide(nn.Module):
    """A residual MLP of ``width`` to ``width``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class WideStack(nn.Module):
    """``depth`` :class:`Wide` blocks; the output is the loss, the mean square."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Wide(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()
