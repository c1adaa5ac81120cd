"""A host-bound entry module: a model so small that each step's time is Python and op dispatch.

On such a model every microsecond the training loop adds around ``train_step`` shows in the
steps/s, which is what ``tests/distributed/test_launch_speed.py`` measures: the same entry runs
through ``litegen launch`` and through ``scripts/bench/hand_loop.py``.

    launch: {entry: litegen_zoo.tiny_host_entry}
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 32
DEPTH = 2
SAMPLES = 512


class Block(nn.Module):
    """Pre-norm MLP block with a residual, the shape of a transformer block's MLP half."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TinyModel(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class PairDataset(torch.utils.data.Dataset):
    """(input, target) pairs of random vectors, held in memory."""

    def __init__(self, n: int = SAMPLES, width: int = WIDTH, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, width, generator=gen)
        self.y = torch.randn(n, width, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build(config) -> dict:
    torch.manual_seed(config.global_seed)
    model = TinyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, foreach=True)
    return {"model": model, "optimizer": optimizer, "dataset": PairDataset()}


def train_step(batch, model, **_) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
