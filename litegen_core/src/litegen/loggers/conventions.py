"""What the sinks and the writers of metrics and samples agree on: the tag of each metric key,
the sample files the sinks read, and the frame rate of sample videos.

Example:
    >>> scalar_tag("loss"), GIF_FRAME_MS
    ('train/loss', 125)
"""

from __future__ import annotations

MEDIA_SUFFIXES = frozenset({".png", ".gif", ".mp4"})
"""The files in a samples folder that reach the loggers."""

FRAMES_PER_SECOND = 8
GIF_FRAME_MS = 1000 // FRAMES_PER_SECOND

# Record keys whose logger tag is not ``train/<key>``: the validation loss is its own section,
# so dashboards plot it beside, not among, the training scalars.
_TAGS = {"val_loss": "val/loss"}


def scalar_tag(key: str) -> str:
    """The TensorBoard and W&B tag of a ``metrics.jsonl`` key.

    >>> scalar_tag("loss"), scalar_tag("val_loss")
    ('train/loss', 'val/loss')
    """
    return _TAGS.get(key, f"train/{key}")
