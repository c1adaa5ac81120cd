"""2x2 latent packing, shared by the families whose transformer takes packed image tokens
(Flux.1 and Kontext, Flux.2, Qwen-Image and its Edit model): latents ``(B, C, H, W)`` become
``(B, H/2 * W/2, 4C)`` tokens in the channel order of their pipelines' ``_pack_latents``, and
the prediction is unpacked back.

Example::

    from litegen.families.packing import image_ids, pack, unpack

    tokens = pack(latents)                     # (B, H/2 * W/2, 4C)
    same = unpack(tokens, *latents.shape[-2:])  # == latents
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents as (B, H/2 * W/2, C * 4) tokens of 2x2 patches, as FluxPipeline."""
    b, c, h, w = latents.shape
    tokens = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return tokens.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack`."""
    b, _, channels = tokens.shape
    c = channels // 4
    patches = tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, height, width)


def image_ids(height: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of the packed tokens: (0, row, column), made on ``device``
    (made on the host and copied, they would make every training step wait for the copy)."""
    import torch

    ids = torch.zeros(height // 2, width // 2, 3, device=device)
    ids[..., 1] = torch.arange(height // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(width // 2, device=device)[None, :]
    return ids.view(-1, 3)


__all__ = ["image_ids", "pack", "unpack"]
