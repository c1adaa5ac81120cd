"""Bucketed global batches for variable resolutions and durations.

Samples are grouped by a key (their shape, say ``(frames, height, width)``); every global batch
comes from one bucket, so every rank and micro-step of a step sees tensors of one shape and a
batch stacks without padding. Epoch ``e`` permutes each bucket with a generator seeded by
``(seed, e)``, cuts it into whole global batches (the remainder, a different set of samples each
epoch, waits for a later epoch) and shuffles the batches of all buckets together. Optimizer step
``s`` takes global batch ``s`` of that sequence and cuts it into micro-steps and data-parallel
slices exactly as :class:`~litegen.data.GlobalBatchSampler` does, so the cursor is the step and
means the same at any world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence

import torch
from torch.utils.data import Sampler


@dataclasses.dataclass(eq=False)
class BucketBatchSampler(Sampler[list[int]]):
    """Global batches of samples that share a bucket key, sliced for this rank.

    ``keys[i]`` is the bucket of sample ``i`` (any hashable: a shape tuple, a resolution
    name). Put it in a DataLoader; ``prepare`` fills in the job's fields (``global_batch_size``,
    ``max_steps``, ranks, ``grad_accum_steps``, and ``seed`` from ``global_seed`` unless given).

    Example:
        >>> keys = [(32, 32)] * 6 + [(64, 32)] * 4
        >>> sampler = BucketBatchSampler(keys, global_batch_size=2, max_steps=4)
        >>> [{keys[i] for i in batch} for batch in sampler][0] in ({(32, 32)}, {(64, 32)})
        True

        In a training script::

            loader = DataLoader(dataset, batch_sampler=BucketBatchSampler(keys))
            model, optimizer, loader = gen.prepare(model, optimizer, loader)
    """

    keys: Sequence[Hashable]
    global_batch_size: int | None = None
    max_steps: int | None = None
    dp_rank: int = 0
    dp_size: int = 1
    grad_accum_steps: int = 1
    seed: int | None = None
    start_step: int = 0

    def __post_init__(self) -> None:
        if len(self.keys) < 1:
            raise ValueError("BucketBatchSampler got no keys: pass one bucket key per sample.")
        buckets: dict[Hashable, list[int]] = {}
        for index, key in enumerate(self.keys):
            buckets.setdefault(key, []).append(index)  # first-seen order: no hash order
        self._buckets = [torch.tensor(indices) for indices in buckets.values()]
        self._bucket_keys = list(buckets)
        self._epoch: int | None = None
        self._batches: list[torch.Tensor] = []
        if self.global_batch_size is not None:
            self._check()

    def for_job(self, *, seed: int, **job: int) -> BucketBatchSampler:
        """A copy with the job's fields; ``seed`` only where the user gave none."""
        return dataclasses.replace(self, seed=self.seed if self.seed is not None else seed, **job)

    def _check(self) -> None:
        per_step = self.dp_size * self.grad_accum_steps
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} must be a multiple of data-parallel "
                f"size x trainer.grad_accum_steps = {self.dp_size} x {self.grad_accum_steps}."
            )
        if self.batches_per_epoch == 0:
            sizes = {str(k): len(b) for k, b in zip(self._bucket_keys, self._buckets, strict=True)}
            raise ValueError(
                f"no bucket holds a whole global batch of {self.global_batch_size} samples "
                f"(bucket sizes: {sizes}); lower global_batch_size or merge small buckets."
            )

    @property
    def batches_per_epoch(self) -> int:
        return sum(len(b) // self.global_batch_size for b in self._buckets)

    def bucket_sizes(self) -> dict[Hashable, int]:
        """Samples per bucket key (for the log)."""
        return {k: len(b) for k, b in zip(self._bucket_keys, self._buckets, strict=True)}

    def __len__(self) -> int:
        return (self._job("max_steps") - self.start_step) * self.grad_accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        global_batch, max_steps = self._job("global_batch_size"), self._job("max_steps")
        micro = global_batch // (self.dp_size * self.grad_accum_steps)
        for step in range(self.start_step, max_steps):
            batch = self.global_batch(step)
            for m in range(self.grad_accum_steps):
                first = (m * self.dp_size + self.dp_rank) * micro
                yield batch[first : first + micro].tolist()

    def global_batch(self, step: int) -> torch.Tensor:
        """The dataset indices of optimizer step ``step``'s whole global batch."""
        epoch, offset = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            self._batches = self._epoch_batches(epoch)
            self._epoch = epoch
        return self._batches[offset]

    def _epoch_batches(self, epoch: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed((self.seed or 0) * 1_000_003 + epoch)
        batches = []
        for bucket in self._buckets:
            shuffled = bucket[torch.randperm(len(bucket), generator=generator)]
            whole = len(bucket) // self.global_batch_size * self.global_batch_size
            if whole:  # an empty tensor splits into one empty batch, not into none
                batches.extend(shuffled[:whole].split(self.global_batch_size))
        order = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in order]

    def _job(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"BucketBatchSampler.{name} is not set: pass the DataLoader to gen.prepare, "
                f"which sets it from the config, or give {name}= yourself."
            )
        return value

    def state_at(self, step: int) -> dict[str, int]:
        """The state that resumes before optimizer step ``step``: the step is the cursor."""
        return {"start_step": step}

    def state_dict(self) -> dict[str, int]:
        return {"start_step": self.start_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start_step = int(state["start_step"])
