"""The bucket rule of a media folder: each file's ``(frames, height, width)`` from its own
aspect ratio and length, without reading its pixels (no torch, so a launcher can check a folder
before any rank starts).

Example:
    >>> rule = MediaBuckets(resolution=64, spatial_multiple=16, max_frames=17)
    >>> rule.frame_count(30)
    17
"""

from __future__ import annotations

import dataclasses
import math

from litegen.data.media_files import MediaFile

Bucket = tuple[int, int, int]  # (frames, height, width)


@dataclasses.dataclass(frozen=True)
class MediaBuckets:
    """The rule that gives each file its ``(frames, height, width)``.

    ``max_frames=1`` (the default) is for image models: samples are ``[C, H, W]`` and a video
    gives its first frame. Above 1, samples are ``[C, F, H, W]`` and an image is a one-frame
    video. ``aspect_ratios`` are width / height.

    Example:
        >>> from pathlib import Path
        >>> rule = MediaBuckets(resolution=64, spatial_multiple=16, max_frames=17)
        >>> rule.bucket(MediaFile(Path("a.mp4"), "a fox", 640, 360, frames=30, is_video=True))
        (17, 48, 80)
    """

    resolution: int = 512
    spatial_multiple: int = 16
    aspect_ratios: tuple[float, ...] = (1 / 2, 9 / 16, 2 / 3, 3 / 4, 1, 4 / 3, 3 / 2, 16 / 9, 2)
    max_frames: int = 1
    temporal_compression: int = 4
    frame_stride: int = 1

    def __post_init__(self) -> None:
        if self.resolution < self.spatial_multiple:
            raise ValueError(
                f"resolution={self.resolution} is below spatial_multiple={self.spatial_multiple}."
            )
        if self.max_frames < 1 or (self.max_frames - 1) % self.temporal_compression:
            raise ValueError(
                f"max_frames={self.max_frames} must be k * temporal_compression + 1 "
                f"(temporal_compression={self.temporal_compression}), e.g. "
                f"{(self.max_frames - 1) // self.temporal_compression * self.temporal_compression + 1}."
            )
        if self.frame_stride < 1 or not self.aspect_ratios:
            raise ValueError("frame_stride must be >= 1 and aspect_ratios must not be empty.")

    @property
    def is_video(self) -> bool:
        return self.max_frames > 1

    def bucket(self, file: MediaFile) -> Bucket:
        """The ``(frames, height, width)`` this file is trained at."""
        ratio = min(self.aspect_ratios, key=lambda r: abs(math.log(r * file.height / file.width)))
        m = self.spatial_multiple
        width = max(m, round(self.resolution * math.sqrt(ratio) / m) * m)
        height = max(m, round(self.resolution / math.sqrt(ratio) / m) * m)
        return self.frame_count(file.frames), height, width

    def frame_count(self, available: int) -> int:
        """The longest ``k * temporal_compression + 1`` frames ``available`` frames give."""
        usable = min((available - 1) // self.frame_stride + 1, self.max_frames)
        return (usable - 1) // self.temporal_compression * self.temporal_compression + 1


__all__ = ["Bucket", "MediaBuckets"]
