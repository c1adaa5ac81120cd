"""The DataLoader ``prepare`` returns, built from a dataset or from the user's own DataLoader.

| what ``prepare`` gets | what it returns |
| --- | --- |
| a map-style dataset | a DataLoader over :class:`GlobalBatchSampler` (``global_batch_size``) |
| a DataLoader with ``shuffle``/no sampler (a plain ``RandomSampler``/``SequentialSampler``) | the same, with the loader's settings (``global_batch_size`` wins over its ``batch_size``) |
| a DataLoader with a :class:`BucketBatchSampler` | that sampler, given the job's fields |
| a DataLoader with any other sampler or batch sampler | the user's sampler, split between the ranks by :class:`RankBatchSampler` |
| an ``IterableDataset``, or a DataLoader over one | torchdata's ``StatefulDataLoader`` over :class:`RankStream` |

A user's DataLoader keeps its settings (workers, pinning, ``worker_init_fn``, generator, ...);
``num_workers`` and ``pin_memory`` of the config apply to the datasets LiteGen wraps itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from litegen.data.sampler import GlobalBatchSampler
from litegen.data.shape_buckets import BucketBatchSampler
from litegen.data.stream import RankStream, shards_itself
from litegen.data.user_sampler import RankBatchSampler, is_rank_aware

log = logging.getLogger("litegen")

# DataLoader settings a user's loader keeps when prepare rebuilds it around another sampler.
_KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def pair_collate(samples: Sequence[Any]) -> Any:
    """Collate ``(data, caption)`` pairs: data stacked, captions stacked or listed."""
    first = samples[0]
    if not (isinstance(first, tuple | list) and len(first) == 2):
        raise ValueError(
            f"dataset samples must be (data, caption) pairs, got {type(first).__name__}"
            f"{f' of length {len(first)}' if isinstance(first, tuple | list) else ''}; "
            "return pairs from __getitem__ or define a collate_fn on the dataset."
        )
    return default_collate(samples)


def build_dataloader(
    dataset: Dataset,
    *,
    config: Any,
    dp_rank: int,
    dp_size: int,
    collate_fn: Any = None,
    shuffle: bool = True,
    settings: dict[str, Any] | None = None,
) -> DataLoader:
    """Wrap a map-style dataset in a DataLoader over :class:`GlobalBatchSampler`.

    ``settings`` are DataLoader arguments (a user's loader's); without them the config's
    ``num_workers`` and ``pin_memory`` apply.
    """
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            f"prepare needs a dataset with __len__ and __getitem__, or an IterableDataset; got "
            f"{type(dataset).__name__}."
        )
    sampler = GlobalBatchSampler(
        len(dataset),
        global_batch_size=config.global_batch_size,
        max_steps=config.max_steps,
        dp_rank=dp_rank,
        dp_size=dp_size,
        grad_accum_steps=config.trainer.grad_accum_steps,
        seed=config.global_seed,
        shuffle=shuffle,
    )
    settings = settings or {"num_workers": config.num_workers, "pin_memory": config.pin_memory}
    collate = (
        collate_fn
        or settings.get("collate_fn")
        or getattr(dataset, "collate_fn", None)
        or pair_collate
    )
    return DataLoader(dataset, batch_sampler=sampler, **{**settings, "collate_fn": collate})


def prepare_data(data: Any, *, config: Any, dp_rank: int, dp_size: int) -> DataLoader:
    """The DataLoader ``prepare`` returns for a dataset or a DataLoader (see the module table).

    Example::

        loader = prepare_data(DataLoader(ds, batch_sampler=my_buckets), config=cfg,
                              dp_rank=0, dp_size=2)
    """
    job = {"config": config, "dp_rank": dp_rank, "dp_size": dp_size}
    if not isinstance(data, DataLoader):
        if isinstance(data, IterableDataset):
            settings = {"num_workers": config.num_workers, "pin_memory": config.pin_memory}
            collate = getattr(data, "collate_fn", None) or pair_collate
            micro = config.global_batch_size // (dp_size * config.trainer.grad_accum_steps)
            return stream_loader(data, micro, {**settings, "collate_fn": collate}, **job)
        return build_dataloader(data, **job)
    settings = {name: getattr(data, name) for name in _KEPT if hasattr(data, name)}
    dataset = data.dataset
    if isinstance(dataset, IterableDataset):
        _check_batch_size(data.batch_size, **job)
        return stream_loader(dataset, data.batch_size, settings, **job)
    batch_sampler = data.batch_sampler
    if batch_sampler is None:
        raise ValueError(
            "prepare got a DataLoader with batch_size=None over a map-style dataset; give it a "
            "batch_size or a batch_sampler (LiteGen batches the samples for each rank)."
        )
    accum = config.trainer.grad_accum_steps
    if isinstance(batch_sampler, BucketBatchSampler):
        buckets = batch_sampler.for_job(
            global_batch_size=config.global_batch_size,
            max_steps=config.max_steps,
            dp_rank=dp_rank,
            dp_size=dp_size,
            grad_accum_steps=accum,
            seed=config.global_seed,
        )
        log.info("data: %d buckets %s", len(buckets.bucket_sizes()), buckets.bucket_sizes())
        return DataLoader(dataset, batch_sampler=buckets, **settings)
    if _plain_order(data):
        log.info(
            "data: the DataLoader's %s is replaced by LiteGen's resumable global-batch sampler: "
            "global_batch_size %d = %d data-parallel ranks x %d accumulation steps x %d per "
            "micro-batch (its batch_size %s is not used).",
            type(data.sampler).__name__,
            config.global_batch_size,
            dp_size,
            accum,
            config.global_batch_size // (dp_size * accum),
            data.batch_size,
        )
        shuffle = isinstance(data.sampler, RandomSampler)
        return build_dataloader(dataset, **job, shuffle=shuffle, settings=settings)
    rank_aware = is_rank_aware(batch_sampler) or is_rank_aware(data.sampler)
    if rank_aware:
        _check_rank_aware(batch_sampler if is_rank_aware(batch_sampler) else data.sampler, **job)
    _check_batch_size(data.batch_size, **job)
    sampler = RankBatchSampler(
        batch_sampler,
        max_steps=config.max_steps,
        dp_rank=dp_rank,
        dp_size=dp_size,
        grad_accum_steps=accum,
        rank_aware=rank_aware,
        lookahead=data.num_workers * (data.prefetch_factor or 0),
    )
    return DataLoader(dataset, batch_sampler=sampler, **settings)


def stream_loader(
    dataset: IterableDataset,
    batch_size: int | None,
    settings: dict[str, Any],
    *,
    config: Any,
    dp_rank: int,
    dp_size: int,
) -> DataLoader:
    """torchdata's ``StatefulDataLoader`` over :class:`RankStream` (a plain DataLoader, with a
    warning, where torchdata is not installed)."""
    if shards_itself(dataset):
        dataset.set_rank(dp_rank, dp_size)
    else:
        log.info(
            "data: %s has no set_rank(rank, world_size): every rank reads the whole stream and "
            "keeps every %d-th sample (docs/data.md).",
            type(dataset).__name__,
            dp_size,
        )
    stream = RankStream(dataset, dp_rank=dp_rank, dp_size=dp_size)
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        log.warning(
            "data: torchdata is not installed, so a resumed run starts the stream of %s from "
            "its beginning; pip install 'litegen-core[data]' for exact resume.",
            type(dataset).__name__,
        )
        return DataLoader(stream, batch_size=batch_size, **settings)
    return StatefulDataLoader(stream, batch_size=batch_size, **settings)


def _plain_order(loader: DataLoader) -> bool:
    """True for ``shuffle=True``/``False`` loaders: torch's batches of a sequential order or of
    one permutation per epoch, which the global-batch sampler gives too (resumable)."""
    from torch.utils.data import BatchSampler

    sampler = loader.sampler
    plain = type(sampler) is SequentialSampler or (
        type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None
    )
    return plain and type(loader.batch_sampler) is BatchSampler


def _check_rank_aware(sampler: Any, *, config: Any, dp_rank: int, dp_size: int) -> None:
    if (sampler.num_replicas, sampler.rank) != (dp_size, dp_rank):
        raise ValueError(
            f"the DataLoader's {type(sampler).__name__} has num_replicas={sampler.num_replicas}, "
            f"rank={sampler.rank}, but this rank reads data-parallel part {dp_rank} of "
            f"{dp_size}; build it with num_replicas=gen.plan.dp_size, rank=gen.plan.dp_rank, or "
            "use a sampler that does not know the ranks and LiteGen splits its batches."
        )


def _check_batch_size(batch_size: int | None, *, config: Any, dp_rank: int, dp_size: int) -> None:
    """Warn when ``global_batch_size`` (used for samples/s) is not what the loader reads."""
    if batch_size is None:
        return
    per_step = batch_size * dp_size * config.trainer.grad_accum_steps
    if per_step != config.global_batch_size:
        log.warning(
            "data: the DataLoader's batch_size %d is per rank and micro-step, so a step reads "
            "%d samples, but global_batch_size is %d (which the logs' samples/s count); set "
            "global_batch_size: %d.",
            batch_size,
            per_step,
            config.global_batch_size,
            per_step,
        )
