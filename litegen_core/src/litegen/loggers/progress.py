"""Training progress on rank 0's stdout: a rich bar on a terminal, plain lines elsewhere.

On a terminal the bar is drawn from the training loop itself, at most every ``REFRESH_S``
seconds: rich's own refresh thread would re-render it ten times a second, taking the GIL from
the loop. Elsewhere (a log file, a cluster job's output) each logged step prints one line::

    step 120/1000  loss 0.1234  samples/s 431.2  mfu 38.1%  mem 40.2/42.0 GiB (29%)  eta 0:06:12

Example:
    >>> display = progress_display(total=1000, start=0)
    >>> display.record(120, status_of({"loss": 0.1234, "samples_per_s": 431.2}))
    step 120/1000  loss 0.1234  samples/s 431.2  eta ...
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from rich import get_console
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from litegen.memory.stats import format_peak_memory

REFRESH_S = 0.25


def status_of(values: dict[str, Any]) -> str:
    """The short status of one record: loss, val_loss, samples/s, MFU and peak memory if known.

    Example:
        >>> status_of({"loss": 0.1234, "samples_per_s": 431.2, "mfu": 0.381})
        'loss 0.1234  samples/s 431.2  mfu 38.1%'
    """
    parts = []
    for key in ("loss", "val_loss"):
        if isinstance(values.get(key), float | int):
            parts.append(f"{key} {values[key]:.4g}")
    if isinstance(values.get("samples_per_s"), float | int):
        parts.append(f"samples/s {values['samples_per_s']:.1f}")
    if isinstance(values.get("mfu"), float | int):
        parts.append(f"mfu {100 * values['mfu']:.1f}%")
    memory = format_peak_memory({k: v for k, v in values.items() if k.startswith("peak_")})
    return "  ".join([*parts, memory] if memory else parts)


class ProgressBar:
    """A rich bar redrawn from the loop at most every ``REFRESH_S`` seconds (a terminal)."""

    def __init__(self, total: int, start: int, console: Console) -> None:
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            auto_refresh=False,
            console=console,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, completed=start, status="")
        self._step, self._status, self._drawn = start, "", 0.0

    def record(self, step: int, status: str) -> None:
        self._status = status
        self.advance(step)

    def advance(self, step: int) -> None:
        self._step = max(step, self._step)
        if time.monotonic() - self._drawn >= REFRESH_S:
            self._progress.update(self._task, completed=self._step, status=self._status)
            self._progress.refresh()
            self._drawn = time.monotonic()

    def close(self) -> None:
        self._progress.update(self._task, completed=self._step, status=self._status)
        self._progress.stop()


class ProgressLines:
    """One flushed line per logged step (not a terminal); ``advance`` prints nothing."""

    def __init__(self, total: int, start: int, console: Console) -> None:
        self.total, self.start, self.console = total, start, console
        self._began = time.monotonic()

    def record(self, step: int, status: str) -> None:
        line = f"step {step}/{self.total}  {status}" if status else f"step {step}/{self.total}"
        done = step - self.start
        if done > 0:
            left = (time.monotonic() - self._began) / done * max(self.total - step, 0)
            line += f"  eta {datetime.timedelta(seconds=round(left))}"
        self.console.file.write(line + "\n")
        self.console.file.flush()

    def advance(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_display(
    total: int, start: int, console: Console | None = None
) -> ProgressBar | ProgressLines:
    """A bar when ``console`` is a terminal, plain lines otherwise. The default is rich's
    global console (stdout), which rich's log handler shares, so log lines print above the bar."""
    console = console or get_console()
    kind = ProgressBar if console.is_terminal else ProgressLines
    return kind(total, start, console)


__all__ = ["REFRESH_S", "ProgressBar", "ProgressLines", "progress_display", "status_of"]
