"""A rank stops when its launcher dies, however it died (SIGKILL included).

torchrun starts every rank in a session of its own, so a signal to the launcher's process
group does not reach the ranks, and a launcher killed with SIGKILL cannot stop them: they would
train on, writing into the run folder. Each rank therefore asks Linux for a parent-death signal
(``prctl(PR_SET_PDEATHSIG)``); where that is not available it polls its parent instead. The
launcher of each node passes its pid, so on a multi-node job every node's ranks watch their own
launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

LAUNCHER_PID_ENV = "LITEGEN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def die_with_launcher(environ: Mapping[str, str] | None = None) -> str:
    """Arrange for this process to stop as soon as its launcher is gone; returns how.

    The launcher is ``$LITEGEN_LAUNCHER_PID`` (set by ``litegen launch``), else the parent.
    Returns ``"prctl"`` (the kernel sends SIGKILL when the parent dies) or ``"watchdog"`` (a
    thread polls the parent every ``POLL_S`` seconds).

    Example (first thing a worker does)::

        die_with_launcher()
    """
    env = os.environ if environ is None else environ
    launcher = int(env.get(LAUNCHER_PID_ENV) or os.getppid())
    how = "prctl" if _parent_death_signal(signal.SIGKILL) else "watchdog"
    # The launcher may have died before the signal was armed: this process was re-parented then.
    if os.getppid() != launcher:
        _stop(launcher)
    if how == "watchdog":
        threading.Thread(
            target=_watch, args=(launcher,), name="litegen-launcher-watch", daemon=True
        ).start()
    return how


def _parent_death_signal(sig: signal.Signals) -> bool:
    """Ask the kernel to send ``sig`` when the parent exits (Linux only); False if unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_S)
    _stop(launcher)


def _stop(launcher: int) -> None:
    sys.stderr.write(f"litegen: the launcher (pid {launcher}) is gone; this rank stops.\n")
    sys.stderr.flush()
    os._exit(1)
