"""Entry module of recipes/digits_dit.yaml: a small class-conditional DiT on 8x8 digits.

    uv run litegen launch recipes/digits_dit.yaml

Rectified flow: x_t = (1 - t) x_0 + t * noise, the model predicts the velocity noise - x_0;
sampling integrates it from pure noise (t = 1) to an image (t = 0) with Euler steps and
classifier-free guidance. ``sample`` draws a grid every ``trainer.sample_every`` steps and
``finish`` one at the end, both from the EMA weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

NUM_CLASSES = 10


class Digits(Dataset):
    """scikit-learn's 1797 handwritten digits as (image in [-1, 1] of shape 1x8x8, label)."""

    def __init__(self) -> None:
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32) / 8.0 - 1.0
        self.images = images.unsqueeze(1)
        self.labels = torch.tensor(digits.target, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10_000) * torch.arange(half, device=t.device) / half)
    angles = t[:, None] * 1000 * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class DiTBlock(nn.Module):
    """Pre-norm transformer block modulated by the conditioning (adaLN-zero)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )
        self.modulation = nn.Linear(hidden, 6 * hidden)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(c).unsqueeze(1).chunk(6, -1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class DiT(nn.Module):
    """Patchify, add positions, condition on (time, class), run blocks, unpatchify.

    ``channels`` x ``image_size`` x ``image_size`` inputs: 1x8x8 digits here, autoencoder
    latents in ``digits_latent_dit.py``.
    """

    def __init__(
        self,
        hidden_size: int,
        depth: int,
        num_heads: int,
        patch_size: int,
        channels: int = 1,
        image_size: int = 8,
    ) -> None:
        super().__init__()
        self.channels, self.patch, self.grid = channels, patch_size, image_size // patch_size
        token = channels * patch_size * patch_size
        self.embed = nn.Linear(token, hidden_size)
        self.pos = nn.Parameter(torch.randn(1, self.grid * self.grid, hidden_size) * 0.02)
        self.time = nn.Sequential(
            nn.Linear(hidden_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.label = nn.Embedding(NUM_CLASSES + 1, hidden_size)  # the last row is "no class"
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False)
        self.out = nn.Linear(hidden_size, token)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, c, p, g = x.shape[0], self.channels, self.patch, self.grid
        tokens = x.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
        h = self.embed(tokens) + self.pos
        cond = self.time(timestep_embedding(t, self.hidden_size)) + self.label(y)
        for block in self.blocks:
            h = block(h, cond)
        out = self.out(self.norm(h))
        return out.reshape(b, g, g, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, g * p, g * p)


def make_optimizer(model: nn.Module, config) -> tuple[torch.optim.Optimizer, object]:
    """AdamW with 100 warm-up steps, then cosine decay to zero at ``max_steps``."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / config.max_steps))
        ),
    )
    return optimizer, scheduler


def make_dit(config, channels: int = 1, image_size: int = 8) -> DiT:
    """The digits DiT sized by the recipe's ``model`` section."""
    sizes = {k: config.model[k] for k in ("hidden_size", "depth", "num_heads", "patch_size")}
    return DiT(**sizes, channels=channels, image_size=image_size)


def build(config):
    """Everything to prepare: the model, its optimizer and the data set."""
    model = make_dit(config)
    optimizer, scheduler = make_optimizer(model, config)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "dataset": Digits()}


def flow_loss(model: nn.Module, x0: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """Rectified-flow loss on clean inputs ``x0``, with labels dropped for guidance."""
    drop = torch.rand(labels.shape, device=labels.device) < config.model.class_dropout
    labels = torch.where(drop, torch.full_like(labels, NUM_CLASSES), labels)
    t = torch.rand(x0.shape[0], device=x0.device)
    noise = torch.randn_like(x0)
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
    return nn.functional.mse_loss(model(x_t, t, labels), noise - x0)


def train_step(batch, model, config):
    """Rectified-flow loss of one micro-batch of images."""
    images, labels = batch
    return flow_loss(model, images, labels, config)


@torch.no_grad()
def euler_sample(
    model: nn.Module,
    labels: torch.Tensor,
    steps: int,
    guidance: float,
    seed: int,
    shape: tuple[int, ...] = (1, 8, 8),
) -> torch.Tensor:
    """Euler integration from noise (t = 1) to data (t = 0) with classifier-free guidance."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(len(labels), *shape, generator=generator).to(labels.device)
    null = torch.full_like(labels, NUM_CLASSES)
    for i in range(steps, 0, -1):
        t = torch.full((len(labels),), i / steps, device=labels.device)
        v_cond, v_null = model(
            torch.cat([x, x]), torch.cat([t, t]), torch.cat([labels, null])
        ).chunk(2)
        x = x - (v_null + guidance * (v_cond - v_null)) / steps
    return x


def sample(model, config):
    """Samples during training (``trainer.sample_every``): one row per digit, drawn with the
    weights the trainer puts in place (the EMA's when the EMA is on); saved as a PNG grid."""
    per_class = config.sampling.per_class
    device = next(model.parameters()).device
    labels = torch.arange(NUM_CLASSES, device=device).repeat_interleave(per_class)
    guidance = config.sampling.guidance
    images = euler_sample(model, labels, config.sampling.steps, guidance, config.global_seed)
    return images.clamp(-1, 1)  # (N, 1, 8, 8) in [-1, 1]


def finish(model, gen, config):
    """Rank 0 draws a grid of samples (EMA weights when the EMA is on): one row per digit."""
    ema_state = gen.full_sampling_state()  # collective: every rank calls it
    if not gen.is_main_process:
        return
    sampler = make_dit(config)
    sampler.load_state_dict(ema_state)
    sampler.eval()
    per_class = config.sampling.per_class
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    images = euler_sample(
        sampler, labels, config.sampling.steps, config.sampling.guidance, config.global_seed
    ).clamp(-1, 1)
    save_grid(
        images.reshape(NUM_CLASSES, per_class, 8, 8), Path(config.get_results_dir()) / "samples.png"
    )


def save_grid(cells: torch.Tensor, path: Path, zoom: int = 6) -> None:
    """Write (rows, cols, 8, 8) images in [-1, 1] as a PNG grid with grey gaps between cells."""
    pixels = ((cells + 1) * 127.5).round().to(torch.uint8).numpy()
    padded = np.pad(pixels, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=96)
    rows, cols, h, w = padded.shape
    grid = padded.transpose(0, 2, 1, 3).reshape(rows * h, cols * w)
    Image.fromarray(np.kron(grid, np.ones((zoom, zoom), dtype=np.uint8))).save(path)
    print(f"samples written to {path}")
