"""A tiny DiT-like model and a deterministic dataset, shared by the distributed tests.

The model has what the strategies care about: repeated transformer blocks in a ``blocks``
ModuleList (the unit FSDP wraps and block detection finds), parameters of several shapes,
biases and LayerNorms, and a conditioning path (adaLN-style scale/shift from a timestep).
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 32
IN_DIM = 8
TOKENS = 4


class Block(nn.Module):
    """Pre-norm attention + MLP, modulated by the conditioning vector (adaLN)."""

    def __init__(self, hidden: int = HIDDEN, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        # No projection biases: the key bias has a zero true gradient (softmax ignores a
        # shift), so Adam would turn rounding noise into different updates per layout.
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)
        )
        self.ada = nn.Linear(hidden, 2 * hidden)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.ada(cond).unsqueeze(1).chunk(2, dim=-1)
        h = self.norm1(x) * (1 + scale) + shift
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyDiT(nn.Module):
    """Tokens in, tokens out: ``model(data, t)`` with data ``(B, TOKENS, IN_DIM)``, t ``(B,)``."""

    def __init__(self, depth: int = 3, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_DIM, hidden)
        self.time = nn.Sequential(nn.Linear(1, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.final_norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, IN_DIM)

    def forward(self, data: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        data = data.to(self.embed.weight.dtype)  # bf16-cast models take fp32 batches
        if t is None:
            t = torch.zeros(data.shape[0], device=data.device, dtype=data.dtype)
        cond = self.time(t.to(data.dtype).unsqueeze(-1))
        x = self.embed(data)
        for block in self.blocks:
            x = block(x, cond)
        return self.head(self.final_norm(x))


class PairDataset(torch.utils.data.Dataset):
    """``n`` deterministic (data, target) pairs; the target is a fixed nonlinear map of data."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randn(n, TOKENS, IN_DIM, generator=gen)
        mix = torch.randn(IN_DIM, IN_DIM, generator=gen) / IN_DIM**0.5
        self.target = torch.tanh(self.data @ mix)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i], self.target[i]


def make_model(seed: int = 0, depth: int = 3) -> TinyDiT:
    """The same weights for the same seed, on every rank and in every run."""
    torch.manual_seed(seed)
    return TinyDiT(depth=depth)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    data, target = batch
    out = model(data)
    return nn.functional.mse_loss(out.float(), target.float())


# -- a diffusers model for LoRA (tests/distributed/test_lora.py, tests/unit/test_lora.py) ----
WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def make_wan(seed: int = 0) -> nn.Module:
    """A two-block ``diffusers.WanTransformer3DModel`` (36k parameters), the same for a seed."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=1,
        out_channels=1,
        text_dim=16,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    )


class WanDataset(torch.utils.data.Dataset):
    """``n`` deterministic ((latent 1x1x8x8, timestep, text 1x16), target) pairs for make_wan."""

    def __init__(self, n: int = 16, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.latents = torch.randn(n, 1, 1, 8, 8, generator=gen)
        self.timesteps = torch.randint(0, 1000, (n,), generator=gen)
        self.texts = torch.randn(n, 1, 16, generator=gen)
        self.targets = torch.randn(n, 1, 1, 8, 8, generator=gen)

    def __len__(self) -> int:
        return len(self.latents)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        return (self.latents[i], self.timesteps[i], self.texts[i]), self.targets[i]


def wan_loss(
    model: nn.Module, batch: tuple[tuple[torch.Tensor, ...], torch.Tensor]
) -> torch.Tensor:
    inputs, targets = batch
    out = model(*inputs, return_dict=False)[0]
    return nn.functional.mse_loss(out.float(), targets.float())
