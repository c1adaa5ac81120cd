"""Rank 0's background publication of a written checkpoint (manifest, marker, rename,
``latest``), and the process group's store through which the other ranks learn it is done."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Publisher:
    """A thread that runs ``fn(*args)`` and keeps its error for :meth:`join`.

    Not a daemon: a run that ends while a checkpoint is being published finishes publishing it.

    Example:
        >>> published = []
        >>> publisher = Publisher(published.append, "step_1000")
        >>> publisher.join() is None, published
        (True, ['step_1000'])
    """

    def __init__(self, fn: Callable[..., None], *args: Any) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(fn, *args), name="litegen-checkpoint-publish"
        )
        self._thread.start()

    def _run(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as err:  # re-raised in the training thread by join()
            self.error = err

    def join(self) -> BaseException | None:
        """Wait for the thread; return its error, if any."""
        self._thread.join()
        return self.error


def default_store() -> Any:
    """The default process group's store (None where torch keeps none).

    Example::

        default_store().set("litegen/done", "1")
    """
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()  # private, present in torch 2.x
    except (AttributeError, RuntimeError, ValueError):
        return None
