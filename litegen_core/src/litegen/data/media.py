"""A dataset over a folder of images and videos with captions, in shape buckets.

Every file gets a bucket ``(frames, height, width)`` from its own aspect ratio and length
(:class:`MediaBuckets`): the nearest of a few aspect ratios at about ``resolution²`` pixels, with
sides a multiple of ``spatial_multiple`` (the VAE's downsampling times the patch size), and the
longest ``k * temporal_compression + 1`` frames the clip holds up to ``max_frames`` (the ``4k+1``
of Wan and HunyuanVideo, ``8k+1`` of LTX-Video). A sample is resized to cover its bucket and
cropped in the middle, so a :class:`~litegen.data.BucketBatchSampler` over
:attr:`MediaDataset.keys` stacks batches without padding.

Example::

    dataset = MediaDataset("clips/", buckets=MediaBuckets(resolution=480, max_frames=81))
    loader = DataLoader(dataset, batch_sampler=BucketBatchSampler(dataset.keys))
    model, optimizer, loader = gen.prepare(model, optimizer, loader)
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from litegen.data.media_buckets import Bucket, MediaBuckets
from litegen.data.media_files import MAX_CAPTION_BYTES, VIDEO_SUFFIXES, OnBad, scan_media

log = logging.getLogger("litegen")


class MediaDataset(Dataset):
    """``(pixels, caption)`` samples of a media folder, pixels in ``[-1, 1]``, bucketed.

    ``keys[i]`` is sample ``i``'s bucket; ``bad`` lists the files left out and why
    (``on_bad="error"`` refuses the folder instead). See :func:`~litegen.data.media_files.scan_media`
    for where captions come from.

    Example::

        dataset = MediaDataset("photos/", buckets=MediaBuckets(resolution=256))
        pixels, caption = dataset[0]
        pixels.shape == (3, *dataset.keys[0][1:])
    """

    def __init__(
        self,
        root: str | Path,
        *,
        buckets: MediaBuckets | None = None,
        recursive: bool = True,
        on_bad: OnBad = "skip",
        max_caption_bytes: int = MAX_CAPTION_BYTES,
        conditions: Mapping[str, Literal["image", "video"]] | None = None,
        required: Collection[str] = (),
    ) -> None:
        self.root = Path(root)
        self.buckets = buckets or MediaBuckets()
        self.files, self.bad = scan_media(
            self.root,
            recursive=recursive,
            on_bad=on_bad,
            max_caption_bytes=max_caption_bytes,
            conditions=conditions,
            required=required,
        )
        self.keys: list[Bucket] = [self.buckets.bucket(file) for file in self.files]
        sizes = ", ".join(f"{k}: {n}" for k, n in sorted(Counter(self.keys).items()))
        log.info("media folder %s: buckets (frames, height, width): %s", self.root, sizes)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        file = self.files[index]
        pixels = self._pixels(file.path, file.is_video, self.keys[index])
        if not self.buckets.is_video:
            return pixels[0], file.caption
        return pixels.transpose(0, 1).contiguous(), file.caption

    def conditions(self, index: int) -> dict[str, torch.Tensor]:
        """Sample ``index``'s condition files by name, read as its clip is: at its bucket's
        size, an image ``(C, H, W)``, a video ``(C, T, H, W)`` of its bucket's frames."""
        out = {}
        for name, path in self.files[index].conditions:
            is_video = path.suffix.lower() in VIDEO_SUFFIXES
            pixels = self._pixels(path, is_video, self.keys[index])
            out[name] = pixels.transpose(0, 1).contiguous() if is_video else pixels[0]
        return out

    def _pixels(self, path: Path, is_video: bool, bucket: Bucket) -> torch.Tensor:
        """``path`` read at ``bucket``, ``[F, C, H, W]`` in [-1, 1]."""
        frames, height, width = bucket
        try:
            pixels = (
                _read_video(path, frames, self.buckets.frame_stride)
                if is_video
                else _read_image(path)
            )
        except Exception as error:  # name the file instead of failing deep in a worker
            raise ValueError(
                f"could not decode {path} ({type(error).__name__}: {error}); "
                "re-encode or remove the file."
            ) from error
        return _cover_crop(pixels, height, width).sub(0.5).mul(2)


def _read_image(path: Path) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1)[None]  # [1, C, H, W] uint8


def _read_video(path: Path, frames: int, stride: int) -> torch.Tensor:
    import av

    wanted = range(0, frames * stride, stride)
    kept = []
    with av.open(str(path)) as container:
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if index in wanted:
                kept.append(torch.from_numpy(frame.to_ndarray(format="rgb24")))
            if len(kept) == frames:
                break
    if len(kept) < frames:
        raise ValueError(f"decoded {len(kept)} frames, expected {frames}")
    return torch.stack(kept).permute(0, 3, 1, 2)  # [F, C, H, W] uint8


def _cover_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Resize uint8 ``[F, C, h, w]`` to cover ``height x width``, crop the middle, in [0, 1]."""
    h, w = frames.shape[-2:]
    scale = max(height / h, width / w)
    size = (max(height, round(h * scale)), max(width, round(w * scale)))
    resized = F.interpolate(frames.float() / 255, size=size, mode="bilinear", antialias=True)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    return resized[..., top : top + height, left : left + width].clamp(0, 1)
