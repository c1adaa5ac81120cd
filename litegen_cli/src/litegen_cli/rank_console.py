"""What each rank of `litegen launch` prints to the shared console: one line per event, not
one per rank, and nothing the user cannot act on.

Every rank runs the same code, so a warning raised on one is, nearly always, raised on all; the
console is the launcher's, shared by them. :func:`configure_rank_console` (called by the worker
on every rank, before the entry is imported) makes the console rank 0's:

- LiteGen's own log (logger ``litegen``): rank 0's INFO lines and warnings on the console; the
  other ranks' warnings in their log file, ``<results_dir>/logs/rank_<r>.log`` (where a failed
  rank's traceback goes too), so a rank's own problem is kept without repeating rank 0's;
- Python warnings: rank 0's on the console, the other ranks' in their log file; a deprecation
  notice (``DeprecationWarning``, ``FutureWarning``) whose category is a library's, such as
  diffusers' "`torch_dtype` is deprecated", is dropped on every rank: it says what LiteGen must
  change (its developers see it in the test suite), not what the user must. LiteGen's own
  categories (``DeprecatedFieldWarning`` on a recipe field) stay;
- transformers' and diffusers' own logs: their warnings from rank 0 alone, and transformers'
  advisory notices off (``TRANSFORMERS_NO_ADVISORY_WARNINGS``). A variable the user set wins.

Example (what ``python -m litegen_cli.worker`` does on each rank)::

    configure_rank_console(rank=int(os.environ["RANK"]), results_dir="results/run")
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
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


def configure_rank_console(rank: int, results_dir: str | Path) -> None:
    """Set this rank's console output as the module says. Call once per rank, early."""
    _configure_litegen_log(rank, Path(results_dir))
    _configure_library_logs(rank)
    _configure_python_warnings(rank)


def rank_log_file(results_dir: str | Path, rank: int) -> Path:
    """``<results_dir>/logs/rank_<r>.log``: a rank's warnings (ranks but 0) and traceback."""
    from litegen_cli.failures import LOG_FOLDER

    return Path(results_dir) / LOG_FOLDER / f"rank_{rank}.log"


def _configure_litegen_log(rank: int, results_dir: Path) -> None:
    logger = logging.getLogger("litegen")
    if rank == 0:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, show_time=False, markup=False)
        handler.setFormatter(logging.Formatter("[rank 0] %(message)s"))
        logger.setLevel(logging.INFO)
    else:
        path = rank_log_file(results_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8", delay=True)  # no file if quiet
        handler.setFormatter(logging.Formatter(f"%(levelname)s [rank {rank}] %(message)s"))
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    logger.propagate = False


def _configure_library_logs(rank: int) -> None:
    # Read by each library when it sets up its logger: set before they are imported.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if rank != 0:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def _configure_python_warnings(rank: int) -> None:
    show = warnings.showwarning
    to_log_file = logging.getLogger("litegen.warnings")  # a rank's log file (ranks but 0)

    def show_once_per_event(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if is_library_notice(category):
            return
        if rank == 0:
            show(message, category, filename, lineno, file, line)
        else:
            to_log_file.warning(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show_once_per_event


__all__ = ["configure_rank_console", "is_library_notice", "rank_log_file"]
