"""Sample images and videos as files: a PNG grid of images, an MP4 grid of videos (H.264 through
PyAV), or an animated GIF where PyAV or its H.264 encoder is missing.

Example:
    >>> save_samples(torch.rand(8, 3, 32, 32), Path("results/dit/samples/step_100"))
    [PosixPath('results/dit/samples/step_100/samples.png')]
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from litegen.checkpoint.atomic import atomic_write
from litegen.loggers.conventions import FRAMES_PER_SECOND, GIF_FRAME_MS, MEDIA_SUFFIXES

MP4_CODEC = "libx264"  # H.264: what browsers (W&B) play


def save_samples(samples: Any, out_dir: Path) -> list[Path]:
    """Write ``samples`` into ``out_dir`` and return the files written.

    ``samples``: a tensor, array or list of them; ``(N, C, H, W)`` images become
    ``samples.png``, ``(N, C, T, H, W)`` videos ``samples.mp4`` (one grid per frame; ``samples.gif``
    without PyAV's H.264 encoder, see :func:`mp4_available`); a single
    image ``(C, H, W)`` is one sample. ``C`` is 1, 3 or 4; values in [0, 1], or in [-1, 1]
    when any is negative.
    """
    batch = _as_batch(samples)
    from PIL import Image  # Pillow: only runs that save samples need it

    # Each file is written under a temporary name and renamed (the temporary name hides the
    # suffix, so the format is named), so a failure midway never leaves a truncated sample.
    out_dir.mkdir(parents=True, exist_ok=True)
    if batch.dim() == 4:
        grid = Image.fromarray(_grid(batch))
        return [atomic_write(out_dir / "samples.png", lambda tmp: grid.save(tmp, format="PNG"))]
    # (N, C, T, H, W): one grid per frame.
    grids = [_grid(batch[:, :, t]) for t in range(batch.shape[2])]
    if mp4_available():
        return [atomic_write(out_dir / "samples.mp4", lambda tmp: _write_mp4(grids, tmp))]
    frames = [Image.fromarray(grid) for grid in grids]

    def write_gif(tmp: Path) -> None:
        frames[0].save(
            tmp,
            format="GIF",
            save_all=True,
            append_images=frames[1:],
            duration=GIF_FRAME_MS,
            loop=0,
        )

    return [atomic_write(out_dir / "samples.gif", write_gif)]


def mp4_available() -> bool:
    """True when PyAV is installed with an H.264 encoder (its wheels ship one)."""
    try:
        from av.codec import Codec

        Codec(MP4_CODEC, "w")
    except Exception:  # no PyAV, or an FFmpeg built without the encoder
        return False
    return True


def _write_mp4(grids: list[np.ndarray], path: Path) -> None:
    import av

    height, width = grids[0].shape[:2]
    even = (height + height % 2, width + width % 2)  # yuv420p halves both sides
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream(MP4_CODEC, rate=FRAMES_PER_SECOND)
        stream.height, stream.width = even
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}  # near-lossless: samples are looked at closely
        for grid in grids:
            rgb = np.zeros((*even, 3), dtype=np.uint8)
            rgb[:height, :width] = grid[..., None] if grid.ndim == 2 else grid[..., :3]
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder


def _as_batch(samples: Any) -> torch.Tensor:
    if isinstance(samples, list | tuple):
        samples = torch.stack([torch.as_tensor(np.asarray(s)) for s in samples])
    batch = torch.as_tensor(np.asarray(samples) if not torch.is_tensor(samples) else samples)
    batch = batch.detach().float().cpu()
    if batch.dim() == 3:
        batch = batch.unsqueeze(0)
    if batch.dim() not in (4, 5) or batch.shape[1] not in (1, 3, 4):
        raise ValueError(
            f"sample() returned shape {tuple(batch.shape)}; return images (N, C, H, W) or "
            "videos (N, C, T, H, W) with C = 1, 3 or 4, or None after writing files to out_dir."
        )
    if batch.numel() and batch.min() < 0:
        batch = (batch + 1) / 2
    return batch.clamp(0, 1)


def _grid(images: torch.Tensor, pad: int = 2) -> np.ndarray:
    """``(N, C, H, W)`` in [0, 1] -> one ``uint8`` HWC picture, near-square, padded in black."""
    n, c, h, w = images.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = torch.zeros(c, rows * (h + pad) + pad, cols * (w + pad) + pad)
    for i in range(n):
        top, left = pad + (i // cols) * (h + pad), pad + (i % cols) * (w + pad)
        grid[:, top : top + h, left : left + w] = images[i]
    picture = (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return picture[..., 0] if c == 1 else picture


__all__ = ["MEDIA_SUFFIXES", "mp4_available", "save_samples"]
