"""Data loading for training: samplers that resume exactly, the DataLoader ``prepare`` builds.

- :class:`GlobalBatchSampler` (``sampler.py``): a dataset's global batches, sliced per rank and
  micro-step; the cursor is the optimizer step, the same at any world size.
- :class:`BucketBatchSampler` (``buckets.py``): the same for samples grouped by shape, one
  bucket per global batch (variable resolution and duration).
- :class:`RankBatchSampler` (``user_sampler.py``): a user's own sampler or batch sampler, kept
  and split between the ranks; exact resume through its ``state_dict``.
- :class:`RankStream`, :func:`worker_share` (``stream.py``): iterable and streaming datasets.
- :func:`prepare_data`, :func:`build_dataloader` (``loader.py``): which of these ``prepare``
  uses for what it is given; :func:`data_state` / :func:`load_data_state` (``state.py``): the
  position a run checkpoint saves; :func:`to_device` (``device.py``).
- :class:`MediaDataset` (``media.py``), :class:`MediaBuckets` (``media_buckets.py``),
  :func:`scan_media` (``media_files.py``): a folder of images and videos with captions, in
  shape buckets; the last two import no torch.
- :func:`~litegen.data.vae_encode.vae_encode` (``vae_encode.py``, public as
  ``litegen.utils.encode.vae_encode``): a large batch through a VAE a slice at a time.

torchdata (``pip install 'litegen-core[data]'``) is imported only for iterable datasets, Pillow
and PyAV (``litegen-core[media]``) only when a media folder is read. The names below load
their module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from litegen.data.device import to_device
    from litegen.data.loader import build_dataloader, pair_collate, prepare_data
    from litegen.data.media import MediaDataset
    from litegen.data.media_buckets import MediaBuckets
    from litegen.data.media_files import BadFile, MediaFile, media_paths, scan_media
    from litegen.data.sampler import GlobalBatchSampler
    from litegen.data.shape_buckets import BucketBatchSampler
    from litegen.data.state import data_state, load_data_state
    from litegen.data.stream import RankStream, worker_share
    from litegen.data.user_sampler import RankBatchSampler

# Each name's module, imported on first use: the media scan and the bucket rule import no
# torch, so the CLI checks a media folder before any rank starts without loading it.
_HOMES = {
    "BucketBatchSampler": "shape_buckets",
    "to_device": "device",
    "build_dataloader": "loader",
    "pair_collate": "loader",
    "prepare_data": "loader",
    "MediaDataset": "media",
    "MediaBuckets": "media_buckets",
    "BadFile": "media_files",
    "MediaFile": "media_files",
    "media_paths": "media_files",
    "scan_media": "media_files",
    "GlobalBatchSampler": "sampler",
    "data_state": "state",
    "load_data_state": "state",
    "RankStream": "stream",
    "worker_share": "stream",
    "RankBatchSampler": "user_sampler",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BadFile",
    "BucketBatchSampler",
    "GlobalBatchSampler",
    "MediaBuckets",
    "MediaDataset",
    "MediaFile",
    "RankBatchSampler",
    "RankStream",
    "build_dataloader",
    "data_state",
    "load_data_state",
    "media_paths",
    "pair_collate",
    "prepare_data",
    "scan_media",
    "to_device",
    "worker_share",
]
