"""The DiT-style block the GPU tests train: adaLN-scaled attention and an MLP."""

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
