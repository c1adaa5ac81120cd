"""Entry module of recipes/digits_autoencoder.yaml: a small convolutional autoencoder.

    uv run litegen launch recipes/digits_autoencoder.yaml

Stage 1 of the latent-diffusion pipeline (docs/recipes.md). The encoder maps an 8x8 digit
to a ``latent_channels x 4 x 4`` latent with a plain deterministic ``encode()`` (a tensor,
which ``litegen.utils.encode.vae_encode`` accepts as it is); ``decode()`` maps it back.
The trainer's final save writes ``<checkpoint_dir>/<exp_name>.pth``, which
recipes/digits_latent_dit.py loads with :meth:`DigitsAutoencoder.from_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from digits_dit import Digits, save_grid
from torch import nn


class DigitsAutoencoder(nn.Module):
    """8x8x1 images in [-1, 1] <-> ``latent_channels`` x 4 x 4 latents."""

    def __init__(self, channels: int = 32, latent_channels: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1),  # 8x8 -> 4x4
            nn.SiLU(),
            nn.Conv2d(channels, latent_channels, 1),
        )
        self.decoder = nn.Sequential(
            nn.Conv2d(latent_channels, channels, 3, padding=1),
            nn.SiLU(),
            nn.ConvTranspose2d(channels, channels, 4, stride=2, padding=1),  # 4x4 -> 8x8
            nn.SiLU(),
            nn.Conv2d(channels, 1, 3, padding=1),
            nn.Tanh(),  # the digits are scaled to [-1, 1]
        )

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1, 8, 8) images -> (B, latent_channels, 4, 4) latents."""
        return self.encoder(images)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, latent_channels, 4, 4) latents -> (B, 1, 8, 8) images in [-1, 1]."""
        return self.decoder(latents)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(images))

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> DigitsAutoencoder:
        """Load the weights this recipe saved; the sizes are read from the weights themselves.

        Raises ValueError, naming the command that writes the file, when it is missing.
        """
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"autoencoder checkpoint {path} not found; train the autoencoder first with "
                "`uv run litegen launch recipes/digits_autoencoder.yaml` (it writes "
                "results/digits_autoencoder/digits_autoencoder.pth), or point "
                "autoencoder.checkpoint=PATH at the file it wrote."
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        # encoder.0 maps 1 -> channels, encoder.4 maps channels -> latent_channels.
        model = cls(state["encoder.0.weight"].shape[0], state["encoder.4.weight"].shape[0])
        model.load_state_dict(state)
        return model.eval().requires_grad_(False)


def build(config):
    """The autoencoder, its optimizer and the digits."""
    model = DigitsAutoencoder(config.autoencoder.channels, config.autoencoder.latent_channels)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.max_steps)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "dataset": Digits()}


def train_step(batch, model):
    """Reconstruction error of one micro-batch."""
    images, _labels = batch
    return nn.functional.mse_loss(model(images), images)


@torch.no_grad()
def finish(model, gen, config):
    """Rank 0 reports the reconstruction error and draws digits above their reconstructions."""
    if not gen.is_main_process:
        return
    autoencoder = gen.unwrap(model).eval()
    images = Digits().images
    recon = autoencoder(images)
    print(
        f"autoencoder: reconstruction MSE {nn.functional.mse_loss(recon, images):.4f} "
        f"over {len(images)} digits",
        flush=True,
    )
    cells = torch.stack([images[:40], recon[:40]]).reshape(2, 4, 10, 8, 8)
    grid = cells.transpose(0, 1).reshape(8, 10, 8, 8)  # rows: 4 x (originals, reconstructions)
    save_grid(grid, Path(config.get_results_dir()) / "reconstructions.png")
