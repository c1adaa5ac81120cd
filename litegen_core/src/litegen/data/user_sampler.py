"""A user's own sampler or batch sampler, kept, run to ``max_steps`` and split between the ranks.

Every rank walks the same sequence of the user's batches, epoch after epoch (``set_epoch(e)``
is called on the batch sampler, or its sampler, when it has one). A sampler that does not know
the ranks is split by batches, as accelerate does by default: one optimizer step consumes
``dp_size * grad_accum_steps`` consecutive batches and micro-step ``m`` of data-parallel rank
``r`` takes batch ``m * dp_size + r``. So each batch reaches one rank whole (a bucket sampler's
batches keep their bucket and size), the batch size is per rank, and the position, counted in
batches, means the same at any world size. A rank-aware sampler (one with ``num_replicas`` and
``rank``, such as ``DistributedSampler``) already gives each rank its own batches: a step then
takes ``grad_accum_steps`` of them.

Resume: before each step the position is recorded (epoch, batches drawn in it) together with
the user's own state, taken from whichever of the batch sampler, its ``sampler`` and the
iterator has ``state_dict``/``load_state_dict`` (torchdata's stateful samplers keep theirs in the
iterator). The DataLoader draws batches ahead of training, so a few of these records are kept
and a checkpoint takes the one of the step it resumes at. Without any user state the epoch is
replayed up to the saved position, which repeats the data order only if the sampler draws the
same order again (a seeded generator); LiteGen warns once.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import Sampler

log = logging.getLogger("litegen")


def is_rank_aware(sampler: Any) -> bool:
    """True for samplers that pick their rank's part themselves (``num_replicas`` and ``rank``)."""
    return hasattr(sampler, "num_replicas") and hasattr(sampler, "rank")


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class RankBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches out of a user's batch sampler, for ``max_steps`` steps.

    Example:
        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> user = BatchSampler(SequentialSampler(range(8)), batch_size=2, drop_last=False)
        >>> list(RankBatchSampler(user, max_steps=2, dp_rank=1, dp_size=2))
        [[2, 3], [6, 7]]
    """

    def __init__(
        self,
        batches: Iterable[list[int]],
        *,
        max_steps: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        grad_accum_steps: int = 1,
        rank_aware: bool = False,
        lookahead: int = 2,
    ) -> None:
        self.batches = batches
        self.max_steps = max_steps
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.grad_accum_steps = grad_accum_steps
        self.rank_aware = rank_aware
        self.per_step = grad_accum_steps * (1 if rank_aware else dp_size)
        self.start_step = 0
        self._resume: dict[str, Any] | None = None
        # States before the steps drawn so far; the loader runs at most `lookahead` ahead.
        self._states: deque[tuple[int, dict[str, Any]]] = deque(maxlen=lookahead + 2)
        self._warned = False

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.grad_accum_steps

    # -- the user's objects ---------------------------------------------------------------------
    def _inner(self) -> Any:
        return getattr(self.batches, "sampler", None)

    def _set_epoch(self, epoch: int) -> None:
        for obj in (self.batches, self._inner()):
            if callable(getattr(obj, "set_epoch", None)):
                obj.set_epoch(epoch)
                return

    def _capture(self, epoch: int, drawn: int, iterator: Any) -> dict[str, Any]:
        user = {
            name: copy.deepcopy(obj.state_dict())
            for name, obj in (
                ("batch_sampler", self.batches),
                ("sampler", self._inner()),
                ("iterator", iterator),
            )
            if _stateful(obj)
        }
        return {"epoch": epoch, "drawn": drawn, "user": user, "dp_size": self.dp_size}

    def _open(self) -> tuple[int, int, Iterator[list[int]]]:
        """(epoch, batches drawn in it, iterator) at ``start_step``: restored, or fresh."""
        state, self._resume = self._resume, None
        if state is not None and self.rank_aware and state["dp_size"] != self.dp_size:
            log.warning(
                "the DataLoader's sampler gives each rank its own part, and the run checkpoint "
                "was written with %d data-parallel ranks, not %d: epoch %d starts again.",
                state["dp_size"],
                self.dp_size,
                state["epoch"],
            )
            state = {**state, "drawn": 0, "user": {}}
        if state is None:
            self._set_epoch(0)
            return 0, 0, iter(self.batches)
        epoch, drawn, user = state["epoch"], state["drawn"], state["user"]
        self._set_epoch(epoch)
        if "batch_sampler" in user:
            self.batches.load_state_dict(user["batch_sampler"])
        if "sampler" in user:
            self._inner().load_state_dict(user["sampler"])
        iterator = iter(self.batches)
        if "iterator" in user:
            iterator.load_state_dict(user["iterator"])
        if not user:
            for _ in range(drawn):  # replay the epoch's indices (no data is loaded)
                next(iterator)
        return epoch, drawn, iterator

    def _warn_if_stateless(self, state: dict[str, Any]) -> None:
        if not state["user"] and not self._warned:
            self._warned = True
            log.warning(
                "the DataLoader's %s has no state_dict/load_state_dict: a resumed run replays "
                "the epoch to its position, which repeats the data order only if the sampler "
                "draws the same order again (seed its generator); see docs/data.md.",
                type(self.batches).__name__,
            )

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        epoch, drawn, iterator = self._open()
        self._states.clear()
        self._states.append((self.start_step, self._capture(epoch, drawn, iterator)))
        self._warn_if_stateless(self._states[0][1])
        for step in range(self.start_step, self.max_steps):
            group: list[list[int]] = []
            while len(group) < self.per_step:
                batch = next(iterator, None)
                if batch is None:
                    if drawn == 0:
                        raise ValueError(
                            f"the DataLoader's {type(self.batches).__name__} yielded no batch "
                            f"in epoch {epoch}; check its dataset and batch size."
                        )
                    epoch, drawn = epoch + 1, 0
                    self._set_epoch(epoch)
                    iterator = iter(self.batches)
                    continue
                group.append(batch)
                drawn += 1
            self._states.append((step + 1, self._capture(epoch, drawn, iterator)))
            if self.rank_aware:
                yield from group
            else:
                for micro in range(self.grad_accum_steps):
                    yield group[micro * self.dp_size + self.dp_rank]

    # -- resume ----------------------------------------------------------------------------------
    def state_at(self, step: int) -> dict[str, Any]:
        """The state that resumes before optimizer step ``step`` (drawn, or about to be)."""
        for recorded, state in self._states:
            if recorded == step:
                return {**state, "start_step": step}
        raise RuntimeError(
            f"no data state recorded for step {step} (recorded: "
            f"{[s for s, _ in self._states]}); the loader ran further ahead than expected."
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_at`) at the next ``iter``."""
        self.start_step = int(state["start_step"])
        self._resume = state
