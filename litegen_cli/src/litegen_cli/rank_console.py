"""What each rank of `litegen launch` prints to the shared console: one line per event, not
one per rank, and nothing the user cannot act on.

Every rank runs the same code, so a warning raised on one is raised on all; the console is the
launcher's, shared by them. :func:`configure_rank_console` (called by the worker on every rank,
before the entry is imported) sets:

- LiteGen's own log (logger ``litegen``): INFO lines from rank 0, warnings from every rank,
  tagged with it (a rank may be the only one to see its problem);
- Python warnings: shown by rank 0 alone, one per event; a deprecation notice
  (``DeprecationWarning``, ``FutureWarning``) of a library LiteGen calls, such as diffusers'
  ``torch_dtype is deprecated``, is dropped on every rank: it says what LiteGen must change
  (its developers see it in the test suite), not what the user must. LiteGen's own categories
  (``DeprecatedFieldWarning`` on a recipe field) stay;
- transformers' and diffusers' own logs: their warnings from rank 0 alone, and transformers'
  advisory notices off (``TRANSFORMERS_NO_ADVISORY_WARNINGS``). A variable the user set wins.

Example (what ``python -m litegen_cli.worker`` does on each rank)::

    configure_rank_console(rank=int(os.environ["RANK"]))
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

# Deprecation notices of a library say what LiteGen must change, not what the user must.
_LIBRARY_NOTICES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
_OUR_PACKAGES = ("litegen", "litegen_cli", "litegen_zoo")


def is_library_notice(category: type[Warning]) -> bool:
    """True for a deprecation notice whose category is not LiteGen's (a library's or Python's):
    raised in a library or in LiteGen's call to it, it says what LiteGen must change.

    Example:
        >>> is_library_notice(FutureWarning), is_library_notice(UserWarning)
        (True, False)
    """
    ours = category.__module__.split(".")[0] in _OUR_PACKAGES
    return issubclass(category, _LIBRARY_NOTICES) and not ours


def configure_rank_console(rank: int) -> None:
    """Set this rank's console output as the module says. Call once per rank, early."""
    _configure_litegen_log(rank)
    _configure_library_logs(rank)
    _configure_python_warnings(rank)


def _configure_litegen_log(rank: int) -> None:
    from rich.logging import RichHandler

    handler = RichHandler(show_path=False, show_time=False, markup=False)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    logger = logging.getLogger("litegen")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


def _configure_library_logs(rank: int) -> None:
    # Read by each library when it sets up its logger: set before they are imported.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if rank != 0:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def _configure_python_warnings(rank: int) -> None:
    show = warnings.showwarning

    def show_once_per_event(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if rank != 0 or is_library_notice(category):
            return
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once_per_event


__all__ = ["configure_rank_console", "is_library_notice"]
