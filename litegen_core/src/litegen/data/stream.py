"""Iterable and streaming datasets: each data-parallel rank reads its part, epochs repeat.

``prepare`` wraps an ``IterableDataset`` in :class:`RankStream` and loads it with torchdata's
``StatefulDataLoader``, whose ``state_dict`` records, per loader worker, the stream's position
at the batch training has consumed; a run checkpoint saves it and resume continues there.

Which rank reads what:

- a dataset with ``set_rank(rank, world_size)`` reads only its own part: ``prepare`` calls it
  with the data-parallel rank and size, and the dataset splits its shards (files, URLs) between
  the ranks, and between its loader workers, for example with :func:`worker_share`;
- any other dataset is read whole by every rank, which keeps every ``world_size``-th sample of
  each worker's stream (exact, but each rank reads everything: define ``set_rank`` when reading
  is the expensive part).

Position: :class:`RankStream` counts the samples it has taken from the dataset in the current
epoch. When the dataset has ``state_dict``/``load_state_dict`` (torchdata's protocol), that
state is saved with the count and restored before the next ``iter``; otherwise resume reads
the stream again up to the count, which is exact for a stream that yields the same samples in
the same order each time. When a stream ends, the next epoch starts (``set_epoch(e)`` first,
when the dataset has it), so training runs to ``max_steps`` however long an epoch is.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

T = TypeVar("T")


def worker_share(items: Sequence[T], rank: int, world_size: int) -> Sequence[T]:
    """The items of one data-parallel ``rank`` and, inside a loader worker, of this worker.

    For datasets that implement ``set_rank`` and read a list of shards: call it in
    ``__iter__`` (where the worker is known) with the rank and size ``set_rank`` received.

    Example:
        >>> worker_share(["a", "b", "c", "d", "e"], rank=1, world_size=2)  # no workers
        ['b', 'd']
    """
    info = get_worker_info()
    workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
    if len(items) < world_size * workers:
        raise ValueError(
            f"{len(items)} shards cannot give each of {world_size} ranks x {workers} loader "
            "workers one; use fewer num_workers or split the data into more shards."
        )
    return items[rank * workers + worker :: world_size * workers]


def shards_itself(dataset: Any) -> bool:
    """True for datasets that read their rank's part themselves (``set_rank``)."""
    return callable(getattr(dataset, "set_rank", None))


class RankStream(IterableDataset):
    """A user's iterable dataset, repeated over epochs, with this rank's part of each stream.

    Example:
        >>> list(itertools.islice(RankStream(range(5), dp_rank=1, dp_size=2), 4))
        [1, 3, 1, 3]
    """

    def __init__(self, dataset: Any, *, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.dataset = dataset
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.split = not shards_itself(dataset) and dp_size > 1
        self.epoch = 0
        self.taken = 0  # samples taken from the dataset in this epoch (before the rank's choice)
        self._resume: dict[str, Any] | None = None

    def _set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def _stateful(self) -> bool:
        return callable(getattr(self.dataset, "state_dict", None)) and callable(
            getattr(self.dataset, "load_state_dict", None)
        )

    def _open(self) -> Iterator[Any]:
        state, self._resume = self._resume, None
        self.epoch, self.taken = (state["epoch"], state["taken"]) if state else (0, 0)
        self._set_epoch(self.epoch)
        if state is not None and state["dataset"] is not None:
            self.dataset.load_state_dict(state["dataset"])
            return iter(self.dataset)
        return itertools.islice(iter(self.dataset), self.taken, None)

    def __iter__(self) -> Iterator[Any]:
        stream = self._open()
        while True:
            for sample in stream:
                self.taken += 1
                if not self.split or (self.taken - 1) % self.dp_size == self.dp_rank:
                    yield sample
            if self.taken == 0:
                raise ValueError(
                    f"the iterable dataset {type(self.dataset).__name__} yielded no sample in "
                    f"epoch {self.epoch} (on this rank's loader worker)."
                )
            self.epoch, self.taken = self.epoch + 1, 0
            self._set_epoch(self.epoch)
            stream = iter(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """Epoch, samples taken in it, and the dataset's own state when it keeps one."""
        inner = self.dataset.state_dict() if self._stateful() else None
        return {"epoch": self.epoch, "taken": self.taken, "dataset": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter``."""
        self._resume = state
