"""How a failure inside the ranks reaches the user: one message and the right exit code.

Each rank catches its own error (``worker.py``), appends the traceback to
``<results_dir>/logs/rank_<r>.log``, writes its message and exit code into torchrun's error
file, and exits with that code:

- 2, bad input: a ValueError, TypeError or FileNotFoundError raised by LiteGen's own checks (an
  entry without ``train_step``, a checkpoint that is damaged or does not fit the model, ...);
- 130: Ctrl-C (torchrun passes SIGINT on to the ranks); nothing is recorded;
- 1: anything else; the run failed.

The launcher then shows the root failure first (a rank killed from outside, else the earliest
recorded, then the lowest rank: :func:`root_failure`), then the others, and exits with the root
one's code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
BAD_INPUT = (ValueError, TypeError, FileNotFoundError)
LOG_FOLDER = "logs"
# Deaths that no other rank's failure causes (SIGTERM and SIGABRT may follow a stop or a failed
# collective): a rank killed so is the root failure (root_failure).
UNPROVOKED_SIGNALS = {"SIGKILL", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"}
# Where LiteGen's own code lives (found without importing litegen, which imports torch).
_OUR_CODE = tuple(
    Path(folder)
    for name in ("litegen", "litegen_cli")
    for folder in importlib.util.find_spec(name).submodule_search_locations
)


def exit_code_for(err: BaseException) -> int:
    """The exit code a rank ends with after ``err`` (see the module docs).

    >>> exit_code_for(KeyboardInterrupt()), exit_code_for(RuntimeError("boom"))
    (130, 1)
    """
    if isinstance(err, SystemExit):  # sys.exit() in the user's code: its own code
        return err.code if isinstance(err.code, int) else int(err.code is not None)
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(err, BAD_INPUT) and _raised_by_litegen(err):
        return EXIT_BAD_INPUT
    return EXIT_FAILED


def _raised_by_litegen(err: BaseException) -> bool:
    """Whether ``err`` was raised in LiteGen's code (a check), not in the user's or torch's."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = Path(tb.tb_frame.f_code.co_filename)
    return any(where.is_relative_to(root) for root in _OUR_CODE)


def record_failure(err: BaseException, rank: int, results_dir: str | Path | None) -> int:
    """Log ``err``'s traceback, record its message for the launcher; return the exit code.

    Without torchrun's error file (the worker run by hand) the traceback goes to stderr.
    """
    code = exit_code_for(err)
    if code in (0, EXIT_INTERRUPTED):
        return code
    text = "".join(traceback.format_exception(err))
    log = _append_log(text, rank, results_dir)
    record = {
        "message": f"{type(err).__name__}: {err}",
        "extraInfo": {
            "py_callstack": text,
            "timestamp": str(int(time.time())),
            "litegen": {"exit_code": code, "time": time.time(), "log": log},
        },
    }
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        from litegen.checkpoint.atomic import atomic_write_text

        # torchrun may kill this rank while it writes (another rank died first), then parses
        # every file it finds: a half-written one would crash torchrun itself and stop restarts.
        atomic_write_text(error_file, json.dumps({"message": record}))
    else:
        sys.stderr.write(text)
    return code


def _append_log(text: str, rank: int, results_dir: str | Path | None) -> str | None:
    if results_dir is None:
        return None
    path = Path(results_dir) / LOG_FOLDER / f"rank_{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{text}")
    except OSError:
        return None
    return str(path)


# -- the launcher's side -------------------------------------------------------------------------
@dataclass
class RankFailure:
    """One failed rank, as torchrun reports it (with what the rank recorded, if anything)."""

    rank: int
    exitcode: int
    message: str
    time: float = 0.0  # when the rank recorded its error; 0 when it recorded none
    log: str | None = None

    @property
    def signal(self) -> str | None:
        """The signal that killed the rank (``"SIGKILL"``), or None when it exited.

        >>> RankFailure(1, -9, "").signal
        'SIGKILL'
        """
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


def rank_failure(rank: int, failure: Any) -> RankFailure:
    """A :class:`RankFailure` from one of torchrun's ``ProcessFailure`` objects."""
    message = failure.message or ""
    extra: dict[str, Any] = {}
    if isinstance(message, dict):  # the error file: {"message": ..., "extraInfo": ...}
        extra = (message.get("extraInfo") or {}).get("litegen") or {}
        message = message.get("message", "")
    message = str(message).strip()
    if not message and failure.exitcode < 0:
        message = f"killed by signal {failure.signal_name()}"
    return RankFailure(
        rank,
        failure.exitcode,
        message or "no error recorded",
        time=float(extra.get("time", 0.0)),
        log=extra.get("log"),
    )


def root_failure(failures: list[RankFailure]) -> RankFailure:
    """The failure that caused the others, as torchrun's root-cause record would be if it knew
    when an unrecorded death happened.

    First a rank killed from outside (SIGKILL, or a crash of its own such as SIGSEGV) without
    recording an error: no other rank's failure kills it, while the ranks left blocked in a
    collective with it fail next and record that. torchrun stops the remaining ranks only
    after it gathered the failures, so its own SIGTERM is not among them. Then the earliest
    recorded failure, then the lowest rank.

    >>> root_failure([RankFailure(0, -15, "killed"), RankFailure(1, 2, "ValueError", 5.0)]).rank
    1
    >>> root_failure([RankFailure(0, 1, "RuntimeError: peer gone", 5.0), RankFailure(1, -9, "")]).rank
    1
    """
    killed = [f for f in failures if not f.time and f.signal in UNPROVOKED_SIGNALS]
    if killed:
        return min(killed, key=lambda f: f.rank)
    recorded = [f for f in failures if f.time] or failures
    return min(recorded, key=lambda f: (f.time, f.rank))


def launcher_exit_code(root: RankFailure) -> int:
    """2 when the root failure is bad input, else 1 (a rank killed by a signal included)."""
    return EXIT_BAD_INPUT if root.exitcode == EXIT_BAD_INPUT else EXIT_FAILED


class LaunchFailed(Exception):
    """The worker group failed (or was stopped); carries a short summary, not a traceback.

    ``failures`` lists the failed ranks, the root one first; ``signal`` names the signal that
    stopped the launcher, if one did.
    """

    def __init__(
        self,
        summary: str,
        failures: list[RankFailure] | None = None,
        exit_code: int = 1,
        signal: str | None = None,
    ):
        self.summary = summary
        self.failures = list(failures or [])
        self.exit_code = exit_code
        self.signal = signal
        super().__init__(summary)
