"""The data position a run checkpoint saves per rank, and its restore on resume.

LiteGen's samplers (global-batch, bucket, a user's sampler split between ranks) answer
``state_at(step)``: the state that resumes before that optimizer step, whatever the loader has
already drawn ahead. torchdata's ``StatefulDataLoader`` (iterable datasets) keeps the position of
the batches it has handed out in its own ``state_dict``. Anything else has no position, and
resume starts its data order again (with a warning).

Example::

    state = data_state(loader, step=1000)        # saved in trainer/rank_<r>.pt
    load_data_state(loader, state, step=1000)    # before iter(loader)
"""

from __future__ import annotations

import logging
from typing import Any

from litegen.data.sampler import GlobalBatchSampler
from litegen.data.shape_buckets import BucketBatchSampler

log = logging.getLogger("litegen")


def _is_stateful_loader(loader: Any) -> bool:
    return type(loader).__name__ == "StatefulDataLoader" and hasattr(loader, "state_dict")


def data_state(loader: Any, step: int) -> dict[str, Any] | None:
    """This rank's data position before optimizer step ``step``, or None when it has none."""
    if _is_stateful_loader(loader):
        return {"loader": loader.state_dict(), "dp_size": getattr(loader.dataset, "dp_size", None)}
    sampler = loader.batch_sampler
    if callable(getattr(sampler, "state_at", None)):
        return {"sampler": sampler.state_at(step)}
    return None


def load_data_state(loader: Any, state: dict[str, Any] | None, step: int) -> None:
    """Put back what :func:`data_state` returned (call before ``iter(loader)``).

    A checkpoint without a data state (older ones) resumes LiteGen's cursor samplers at ``step``.
    """
    sampler = loader.batch_sampler
    if state is not None and "loader" in state and _is_stateful_loader(loader):
        ranks = getattr(loader.dataset, "dp_size", None)
        if state.get("dp_size") == ranks:
            loader.load_state_dict(state["loader"])
        else:
            # Each rank's stream position belongs to its share of the stream at that size.
            log.warning(
                "the run checkpoint's data streams were read by %s data-parallel ranks, this "
                "run has %s: the streams start from their beginning.",
                state.get("dp_size"),
                ranks,
            )
    elif state is not None and "sampler" in state and hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(state["sampler"])
    elif isinstance(sampler, GlobalBatchSampler | BucketBatchSampler):
        sampler.load_state_dict({"start_step": step})  # their cursor is the step
    else:
        _restart_warning(loader)


def _restart_warning(loader: Any) -> None:
    log.warning(
        "the data loader (%s) has no saved position to resume from; its data order restarts.",
        type(loader).__name__,
    )
