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
- :class:`MediaDataset`, :class:`MediaBuckets` (``media.py``), :func:`scan_media`
  (``media_files.py``): a folder of images and videos with captions, in shape buckets.

torchdata (``pip install 'litegen-core[data]'``) is imported only for iterable datasets, Pillow
and PyAV (``litegen-core[media]``) only when a media folder is read.
"""

from litegen.data.buckets import BucketBatchSampler
from litegen.data.device import to_device
from litegen.data.loader import build_dataloader, pair_collate, prepare_data
from litegen.data.media import MediaBuckets, MediaDataset
from litegen.data.media_files import BadFile, MediaFile, media_paths, scan_media
from litegen.data.sampler import GlobalBatchSampler
from litegen.data.state import data_state, load_data_state
from litegen.data.stream import RankStream, worker_share
from litegen.data.user_sampler import RankBatchSampler

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
