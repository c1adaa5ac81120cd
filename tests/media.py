"""Tiny media files for tests: PNGs with Pillow, MP4s with PyAV."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def write_png(path: Path, width: int, height: int, color: Sequence[int] = (200, 40, 40)) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((height, width, 3), color, dtype=np.uint8)).save(path)
    return path


def write_mp4(path: Path, width: int, height: int, frames: int, fps: int = 8) -> Path:
    """A clip whose frame ``i`` is a flat grey of level ``min(255, 16 * i)``: frames are told apart."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            array = np.full((height, width, 3), min(255, 16 * i), dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def make_media_folder(root: Path, *, images: int = 4, videos: int = 4, frames: int = 9) -> Path:
    """``root`` with landscape PNGs and MP4s under two subfolders, each with a .txt caption."""
    for i in range(images):
        write_png(root / "photos" / f"image_{i}.png", 48, 32, color=(40 * i, 100, 200))
        (root / "photos" / f"image_{i}.txt").write_text(f"a photo number {i}")
    for i in range(videos):
        write_mp4(root / "clips" / f"clip_{i}.mp4", 48, 32, frames)
        (root / "clips" / f"clip_{i}.txt").write_text(f"a clip number {i}")
    return root
