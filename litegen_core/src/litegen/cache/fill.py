"""Fill a TensorCache ahead of training, split across ranks."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch.distributed as dist

from litegen.cache.store import BatchOutput, TensorCache, split_batch

__all__ = ["fill_cache"]


def fill_cache(
    cache: TensorCache,
    dataset: Any,
    encode_fn: Callable[[list[Any]], BatchOutput],
    *,
    keys: Sequence[Hashable] | None = None,
    batch_size: int = 1,
    rank: int | None = None,
    world_size: int | None = None,
    verify: bool = False,
) -> int:
    """Encode every sample of ``dataset`` the cache lacks; return how many this rank encoded.

    Rank ``r`` of ``world_size`` handles samples ``r, r + world_size, ...``, so ranks never
    encode the same sample; samples already cached (by anyone) are skipped. ``rank`` and
    ``world_size`` default to ``torch.distributed``'s when it is initialized, else 0 and 1.

    Args:
        dataset: supports ``len()`` and ``dataset[i]``.
        encode_fn: gets a list of samples (``dataset[i]`` values), returns one dict of
            tensors per sample or one dict of tensors batched along dim 0.
        keys: the cache key of each sample, aligned with the dataset (default: its index).
        batch_size: samples per ``encode_fn`` call.
        verify: read back every entry this rank would skip and check it against its
            checksums (:meth:`TensorCache.verify`): a damaged one is encoded again. Reads the
            whole share of the cache once; ``litegen cache build`` always does.

    Example:
        >>> import torch
        >>> from litegen.cache import fingerprint
        >>> cache = TensorCache("cache", fingerprint(version=1))
        >>> dataset = [torch.full((4,), float(i)) for i in range(5)]
        >>> fill_cache(cache, dataset, lambda s: {"latent": torch.stack(s)}, batch_size=2)
        5
        >>> fill_cache(cache, dataset, lambda s: {"latent": torch.stack(s)}, batch_size=2)
        0
    """
    if rank is None or world_size is None:
        initialized = dist.is_available() and dist.is_initialized()
        rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        world_size = (
            world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if keys is not None and len(keys) != len(dataset):
        raise ValueError(
            f"got {len(keys)} keys for a dataset of {len(dataset)} samples; pass one key per "
            "sample, in dataset order"
        )

    mine = range(rank, len(dataset), world_size)
    encoded = 0
    for start in range(0, len(mine), batch_size):
        indices = list(mine[start : start + batch_size])
        if verify:  # damaged entries leave the index here, so they land in todo
            cache.verify([_key_of(keys, i) for i in indices if _key_of(keys, i) in cache])
        todo = [i for i in indices if _key_of(keys, i) not in cache]
        if todo:
            cache.refresh()  # a previous or concurrent run may have stored them
            todo = [i for i in todo if _key_of(keys, i) not in cache]
        if not todo:
            continue
        outputs = split_batch(encode_fn([dataset[i] for i in todo]), len(todo))
        for i, tensors in zip(todo, outputs, strict=True):
            cache.put(_key_of(keys, i), tensors)
        encoded += len(todo)
    cache.flush()
    return encoded


def _key_of(keys: Sequence[Hashable] | None, index: int) -> Hashable:
    return index if keys is None else keys[index]
