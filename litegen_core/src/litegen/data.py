"""Datasets become DataLoaders over a resumable, global-batch sampler.

The sampler walks one global sequence of sample positions: epoch ``e`` is a permutation of the
dataset seeded by ``(global_seed, e)``, and optimizer step ``s`` consumes positions
``[s * G, (s + 1) * G)`` for a global batch ``G``. Each step's global batch is cut into
``grad_accum_steps`` micro-steps and each micro-step into ``dp_size`` contiguous slices, one
per data-parallel group (the ranks of one sequence-parallel group read the same slice), so the
union over groups and micro-steps is exactly the single-process batch, and the cursor (the step)
means the same thing at any world size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches of dataset indices, step after step.

    Example:
        >>> sampler = GlobalBatchSampler(10, global_batch_size=4, dp_rank=1, dp_size=2, max_steps=3)
        >>> [len(b) for b in sampler]
        [2, 2, 2]
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        max_steps: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        grad_accum_steps: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if dataset_len < 1:
            raise ValueError("the dataset passed to prepare is empty.")
        per_step = dp_size * grad_accum_steps
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a multiple of data-parallel size "
                f"x trainer.grad_accum_steps = {dp_size} x {grad_accum_steps} = {per_step}."
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = global_batch_size // per_step
        self.max_steps = max_steps
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.grad_accum_steps = grad_accum_steps
        self.seed = seed
        self.shuffle = shuffle
        self.start_step = 0
        self._epoch: int | None = None
        self._perm: torch.Tensor | None = None

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.grad_accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.max_steps):
            for micro in range(self.grad_accum_steps):
                first = (
                    step * self.global_batch_size
                    + (micro * self.dp_size + self.dp_rank) * self.micro_batch_size
                )
                yield [self._index_at(p) for p in range(first, first + self.micro_batch_size)]

    def _index_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.dataset_len)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.dataset_len, generator=generator)
            self._epoch = epoch
        return int(self._perm[offset])

    def state_dict(self) -> dict[str, int]:
        return {"start_step": self.start_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start_step = int(state["start_step"])


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
) -> DataLoader:
    """Wrap a map-style dataset in a DataLoader over :class:`GlobalBatchSampler`."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            f"prepare needs a map-style dataset (with __len__ and __getitem__), got "
            f"{type(dataset).__name__}; pass a DataLoader of your own for iterable datasets."
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
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn or getattr(dataset, "collate_fn", None) or pair_collate,
        num_workers=config.num_workers,
        pin_memory=config.pin_memory,
    )


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a batch (nested tuples, lists and dicts) to ``device``.

    Example:
        >>> images, captions = to_device((images, captions), torch.device("cuda"))
    """
    if isinstance(batch, torch.Tensor):
        # Pinned host memory (pin_memory: true) copies without blocking the host.
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
