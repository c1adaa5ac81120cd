"""The latent cache of a fine-tuning run: its keys, what it encodes and how it is read.

Latents (the pipeline's VAE) and text embeddings (its text encoders) are computed once into a
:class:`litegen.cache.TensorCache` under ``finetune.data.cache_root``: by ``litegen cache
build`` ahead of training, or at the start of the launch for whatever is missing, each rank
encoding its share (rank 0 shows a progress bar). The namespace is a fingerprint of the
pipeline's files (transformer aside), the bucket rule and the family; each entry's key is the
file's path in the media folder, size and modification time (or, with
``finetune.data.cache_content_digest``, a digest of its bytes), its caption and the same of each
of its condition files, so added or edited files are encoded and the rest is read back.

An entry holds the text tensors (:meth:`Family.encode_text_with`: the caption, with the
sample's conditions where the family's text encoder reads them), ``latents``
(:meth:`Family.encode_latents`) and, for each media condition of the family, the tensors of
:meth:`Family.encode_condition`: of the sample's condition file, or of the clip's frame 0 for a
condition whose default is the first frame.

Example::

    cache, dataset, encode, keys = build_cache(config)    # litegen cache build's hook
    loader, empty_prompt = cached_data(config, family)     # what training reads
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, default_collate

from litegen.cache import TensorCache, file_key, fill_cache, fingerprint
from litegen.data import BucketBatchSampler, MediaDataset
from litegen.families import Family
from litegen.finetune.media import media_dataset
from litegen.finetune.pipeline import frozen_pipeline, pipeline_family, pipeline_folder, settings

CACHE_VERSION = 2  # bump when the encoding changes what it stores
EMPTY_PROMPT = "empty-prompt"  # the cache key of the empty caption's text embeddings
# What the cache encodes: (clip pixels or None, caption, condition pixels by name).
Sample = tuple[torch.Tensor | None, str, dict[str, torch.Tensor]]
Samples = list[Sample]


def _files_digest(folder: Path) -> str:
    """Names, sizes and modification times of the pipeline's files, the transformers (Wan 2.2's
    two experts) aside."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and relative.parts[0] not in ("transformer", "transformer_2"):
            stat = path.stat()
            digest.update(f"{relative.as_posix()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def cache_name(config: Any, family: Family, dataset: MediaDataset) -> str:
    """The cache namespace of this pipeline, family and bucket rule: ``<family>-<digest>``."""
    return fingerprint(
        type(family),
        pipeline=_files_digest(pipeline_folder(config)),
        buckets=dataclasses.asdict(dataset.buckets),
        version=CACHE_VERSION,
    )


def cache_keys(dataset: MediaDataset, content_digest: bool = False) -> list[str]:
    """One key per file (:func:`litegen.cache.file_key` of its path in the folder, with its
    caption and its condition files' own keys), then :data:`EMPTY_PROMPT`, as
    :class:`CacheSources` orders them. A file without conditions keeps the key it had."""

    def key(path: Path, extra: str = "") -> str:
        root = dataset.root if path.is_relative_to(dataset.root) else None
        return file_key(path, root=root, extra=extra, content_digest=content_digest)

    keys = []
    for file in dataset.files:
        conditions = "".join(f"|{name}={key(path)}" for name, path in file.conditions)
        keys.append(key(file.path, extra=file.caption + conditions))
    return [*keys, EMPTY_PROMPT]


def media_cache_keys(config: Any, dataset: MediaDataset) -> list[str]:
    """:func:`cache_keys` at ``finetune.data.cache_content_digest``."""
    return cache_keys(dataset, content_digest=settings(config).data.cache_content_digest)


def open_cache(config: Any, family: Family, dataset: MediaDataset) -> TensorCache:
    data = settings(config).data
    name = cache_name(config, family, dataset)
    return TensorCache(data.cache_root, name, dtype=getattr(torch, data.cache_dtype))


class CacheSources(Dataset):
    """What the cache encodes: the media dataset's ``(pixels, caption, conditions)`` samples,
    then the empty caption alone (``(None, "", {})``: text embeddings for caption dropout)."""

    def __init__(self, media: MediaDataset) -> None:
        self.media = media

    def __len__(self) -> int:
        return len(self.media) + 1

    def __getitem__(self, index: int) -> Sample:
        if index == len(self.media):
            return None, "", {}
        pixels, caption = self.media[index]
        return pixels, caption, self.media.conditions(index)


def condition_pixels(
    family: Family, clips: torch.Tensor, given: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Each media condition of ``family`` for a batch of clips of one shape whose samples
    have the same condition files: theirs stacked, or the clips' frame 0 where the
    condition's default is the first frame; an optional one they lack is left out."""
    out = {}
    for name, condition in family.media_conditions.items():
        if name in given[0]:
            out[name] = torch.stack([sample[name] for sample in given])
        elif condition.default == "first_frame":
            out[name] = clips[:, :, 0] if clips.dim() == 5 else clips
    return out


def encoder(config: Any, family: Family, device: torch.device) -> Callable[[Samples], list]:
    """``encode_fn`` of the cache: loads the pipeline without its transformer on first use,
    encodes the samples of each shape together."""
    pipe = None
    batch = settings(config).data.encode_batch_size

    def encode(samples: Samples) -> list[dict[str, torch.Tensor]]:
        nonlocal pipe
        if pipe is None:
            pipe = frozen_pipeline(config).to(device)
        # Samples of one shape and the same condition files are encoded together.
        groups: dict[tuple, list[int]] = {}
        for index, (pixels, _, conditions) in enumerate(samples):
            shape = None if pixels is None else tuple(pixels.shape)
            groups.setdefault((shape, tuple(sorted(conditions))), []).append(index)
        out: list[dict[str, torch.Tensor]] = [{} for _ in samples]
        with torch.no_grad():
            for (shape, _), indices in groups.items():
                captions = [samples[i][1] for i in indices]
                if shape is None:  # the empty caption alone
                    tensors = family.encode_text(pipe, captions)
                else:
                    pixels = torch.stack([samples[i][0] for i in indices])
                    given = condition_pixels(family, pixels, [samples[i][2] for i in indices])
                    tensors = family.encode_text_with(pipe, captions, given)
                    tensors["latents"] = family.encode_latents(pipe, pixels, batch)
                    for name, values in given.items():
                        tensors |= family.encode_condition(pipe, name, values, pixels, batch)
                for row, index in enumerate(indices):
                    out[index] = {name: value[row].cpu() for name, value in tensors.items()}
        return out

    return encode


def device_of(config: Any) -> torch.device:
    if config.runtime.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def build_cache(config: Any) -> tuple[TensorCache, CacheSources, Callable, list[str]]:
    """The hook of ``litegen cache build``: (cache, dataset, encode_fn, keys)."""
    family = pipeline_family(config)
    dataset = media_dataset(config, family)
    encode = encoder(config, family, device_of(config))
    keys = media_cache_keys(config, dataset)
    return open_cache(config, family, dataset), CacheSources(dataset), encode, keys


class CachedSamples(Dataset):
    """The cached latents and text embeddings of the media files, by index."""

    collate_fn = staticmethod(default_collate)  # samples are dicts of tensors

    def __init__(self, cache: TensorCache, keys: list[str]) -> None:
        self.cache, self.keys = cache, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tensors = self.cache.get(self.keys[index])
        if tensors is None:
            raise ValueError(
                f"cache {self.cache.directory} lost entry {self.keys[index]}: run `litegen cache "
                "build` with this recipe to encode it again, then launch again."
            )
        return tensors


@contextlib.contextmanager
def progress_bar(total: int, shown: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar of ``total`` encoded samples (when ``shown``), and its advance."""
    if not shown or total == 0:
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = ("[bold]encoding", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("encoding", total=total)
        yield lambda n: progress.advance(task, n)


def cached_data(config: Any, family: Family) -> tuple[DataLoader, dict[str, torch.Tensor]]:
    """The media folder's samples from the cache, and the empty caption's text embeddings;
    what is missing is encoded first, by all ranks."""
    dataset = media_dataset(config, family)
    data = settings(config).data
    if config.runtime.device == "meta":  # an estimate: read what is there, write nothing
        name = cache_name(config, family, dataset)
        if not (Path(data.cache_root) / name).is_dir():
            raise ValueError(
                f"the cache {Path(data.cache_root) / name} does not exist and an estimate on the "
                "meta device encodes nothing; run `litegen cache build` with this recipe first."
            )
    cache, keys = open_cache(config, family, dataset), media_cache_keys(config, dataset)
    missing = [i for i, key in enumerate(keys) if key not in cache]
    if missing and config.runtime.device == "meta":
        raise ValueError(
            f"the cache {cache.directory} lacks {len(missing)} sample(s) and an estimate on the "
            "meta device encodes nothing; run `litegen cache build` with this recipe first."
        )
    if missing:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        encode = encoder(config, family, device_of(config))
        mine = sum(1 for i in missing if i % world == rank)
        with progress_bar(mine, shown=rank == 0) as advance:

            def encode_and_count(samples: Samples) -> list[dict[str, torch.Tensor]]:
                out = encode(samples)
                advance(len(samples))
                return out

            fill_cache(cache, CacheSources(dataset), encode_and_count, keys=keys,
                       batch_size=data.encode_batch_size, rank=rank, world_size=world)  # fmt: skip
    if dist.is_initialized():
        dist.barrier()  # every rank's share is written before any rank reads
    cache.refresh()
    sampler = BucketBatchSampler(dataset.keys)
    samples = CachedSamples(cache, keys[: len(dataset)])
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=CachedSamples.collate_fn)
    return loader, cache.get(EMPTY_PROMPT)


__all__ = [
    "EMPTY_PROMPT",
    "CacheSources",
    "CachedSamples",
    "build_cache",
    "cache_keys",
    "cache_name",
    "cached_data",
    "condition_pixels",
    "encoder",
    "media_cache_keys",
]
