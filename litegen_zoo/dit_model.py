"""The in-house DiT of the benchmarks and tests (plain PyTorch, no LiteGen).

DiT-XL/2 shaped by default (hidden 1152, depth 28, 16 heads, MLP ratio 4, about 675M
parameters): latent patches in as tokens, a timestep (and class) conditioning vector, adaLN-Zero
blocks with ``F.scaled_dot_product_attention``. The blocks sit in ``model.blocks``, so LiteGen's
block detection and FSDP plans find them.

``hand_checkpoint`` lets a benchmark run the same model with ``torch.utils.checkpoint`` applied
by hand in ``forward``, the reference LiteGen's checkpointing is compared against. The timers
the benchmarks wrap around it live in ``scripts/timing.py``.

Example:
    >>> model = DiT(DiTConfig.tiny())
    >>> x, t = sample_batch(model.cfg, batch=2, tokens=16, device="cpu")
    >>> model(x, t).shape
    torch.Size([2, 16, 16])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class DiTConfig:
    hidden: int = 1152
    depth: int = 28
    heads: int = 16
    mlp_ratio: float = 4.0
    in_dim: int = 16  # a 2x2 patch of a 4-channel latent
    num_classes: int = 1000

    @classmethod
    def tiny(cls) -> DiTConfig:
        """A few blocks of width 64, for CPU smoke runs and tests."""
        return cls(hidden=64, depth=4, heads=4, num_classes=10)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (fractional) timesteps, as in DiT."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class DiTBlock(nn.Module):
    """adaLN-Zero block: the conditioning vector sets shift, scale and gate of both branches."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        inner = int(hidden * mlp_ratio)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, inner), nn.GELU(approximate="tanh"), nn.Linear(inner, hidden)
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=-1)
        x = x + gate1.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift1, scale1))
        return x + gate2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift2, scale2))


class DiT(nn.Module):
    """Tokens ``(B, N, in_dim)`` and timesteps ``(B,)`` (optional labels) in, ``(B, N, in_dim)`` out."""

    def __init__(self, cfg: DiTConfig = DiTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        self.x_embed = nn.Linear(cfg.in_dim, h)
        self.t_embed = nn.Sequential(nn.Linear(256, h), nn.SiLU(), nn.Linear(h, h))
        self.y_embed = nn.Embedding(cfg.num_classes, h)
        self.blocks = nn.ModuleList(DiTBlock(h, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 2 * h))
        self.final_linear = nn.Linear(h, cfg.in_dim)
        # Hand-applied checkpointing (benchmark reference): block indices, an optional
        # ``context_fn`` for selective checkpointing, and whether to offload saved inputs.
        self.hand_checkpoint: set[int] = set()
        self.hand_context_fn: Callable | None = None
        self.hand_offload = False

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None
    ) -> torch.Tensor:
        c = self.t_embed(timestep_embedding(t, 256).to(x.dtype))
        if y is not None:
            c = c + self.y_embed(y)
        x = self.x_embed(x)
        extra = {"context_fn": self.hand_context_fn} if self.hand_context_fn else {}
        offload = (
            torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda)
            if self.hand_offload
            else nullcontext()
        )
        for i, block in enumerate(self.blocks):
            if i in self.hand_checkpoint and torch.is_grad_enabled():
                with offload:
                    x = checkpoint(block, x, c, use_reentrant=False, **extra)
            else:
                x = block(x, c)
        shift, scale = self.final_modulation(c).chunk(2, dim=-1)
        return self.final_linear(modulate(self.final_norm(x), shift, scale))


def compile_blocks_by_hand(model: DiT, mode: str = "default") -> None:
    """torchtitan's regional compile, as a user writes it: each block, before any wrapping."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, mode=mode, dynamic=False)


def sample_batch(
    cfg: DiTConfig, batch: int, tokens: int, device: str | torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random latent tokens and timesteps in [0, 1000)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, tokens, cfg.in_dim, generator=gen, device=device)
    t = torch.randint(0, 1000, (batch,), generator=gen, device=device)
    return x, t
