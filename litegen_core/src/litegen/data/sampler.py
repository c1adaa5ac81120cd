"""The resumable global-batch sampler that ``prepare`` puts under a dataset.

The sampler walks one global sequence of sample positions: epoch ``e`` is a permutation of the
dataset seeded by ``(global_seed, e)``, and optimizer step ``s`` consumes positions
``[s * G, (s + 1) * G)`` for a global batch ``G``. Each step's global batch is cut into
``grad_accum_steps`` micro-steps and each micro-step into ``dp_size`` contiguous slices, one
per data-parallel group (the ranks of one sequence-parallel group read the same slice), so the
union over groups and micro-steps is exactly the single-process batch, and the cursor (the step)
means the same thing at any world size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


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
        self._perm: list[int] = []

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.grad_accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.max_steps):
            for micro in range(self.grad_accum_steps):
                first = (
                    step * self.global_batch_size
                    + (micro * self.dp_size + self.dp_rank) * self.micro_batch_size
                )
                yield self._indices(first, first + self.micro_batch_size)

    def _indices(self, start: int, stop: int) -> list[int]:
        """Dataset indices at sequence positions ``[start, stop)``, epoch by epoch."""
        indices: list[int] = []
        while start < stop:
            epoch, offset = divmod(start, self.dataset_len)
            count = min(stop - start, self.dataset_len - offset)
            if self.shuffle:
                indices += self._permutation(epoch)[offset : offset + count]
            else:
                indices += range(offset, offset + count)
            start += count
        return indices

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.dataset_len, generator=generator).tolist()
            self._epoch = epoch
        return self._perm

    def state_dict(self) -> dict[str, int]:
        return {"start_step": self.start_step}

    def state_at(self, step: int) -> dict[str, int]:
        """The state that resumes before optimizer step ``step``: the step is the cursor."""
        return {"start_step": step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start_step = int(state["start_step"])
