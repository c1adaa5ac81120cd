"""Where training metrics go: JSON lines always, TensorBoard when installed, a rich bar on rank 0.

The bar is drawn from the training loop itself, at most every ``REFRESH_S`` seconds and only
on a terminal: rich's own refresh thread would re-render it ten times a second, taking the
GIL from the loop, and elsewhere (a log file) only the final state is printed, at the end.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from litegen.checkpoint.files import atomic_write_text

REFRESH_S = 0.25


def _keep_records_up_to(path: Path, step: int) -> None:
    """Drop records past ``step``: a resumed run rewrites those steps, a fresh one all of them."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(kept))


def _step_of(line: str) -> int | None:
    """The step of one record; None for a blank line or one cut short by a killed run."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return None


class MetricsLogger:
    """Writes one JSON object per logged step to ``metrics.jsonl`` (rank 0 only).

    Example:
        >>> with MetricsLogger("results/run", total_steps=100, enabled=True) as metrics:
        ...     metrics.log(step=1, loss=0.5)
    """

    def __init__(self, folder: str | Path, *, total_steps: int, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.folder = Path(folder)
        self._file = None
        self._tensorboard = None
        self._progress: Progress | None = None
        self._task = None
        self._total = total_steps
        self._start = start_step
        self._step = start_step
        self._status = ""
        self._terminal = False
        self._refreshed = 0.0

    def __enter__(self) -> MetricsLogger:
        if not self.enabled:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "metrics.jsonl"
        _keep_records_up_to(path, self._start)
        self._file = open(path, "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.folder / "tensorboard"))
        except ImportError:
            self._tensorboard = None
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            auto_refresh=False,
        )
        self._terminal = self._progress.console.is_terminal
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=self._total, completed=self._start, status=""
        )
        return self

    def log(self, step: int, when: float | None = None, **values: Any) -> None:
        """Write one record: ``step``, ``time`` (``when``, else now) and ``values``.

        Non-finite floats are written as ``null``, so every line stays strict JSON.
        """
        if not self.enabled:
            return
        record = {"step": step, "time": time.time() if when is None else when}
        record.update((k, _json_number(v)) for k, v in values.items())
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self._tensorboard.add_scalar(f"train/{key}", value, step)
        self._status = "  ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()
        )
        self.advance(max(step, self._step))

    def advance(self, step: int) -> None:
        """Move the bar to ``step`` (drawn now if the last drawing is ``REFRESH_S`` old)."""
        self._step = step
        if self._terminal and time.monotonic() - self._refreshed >= REFRESH_S:
            self._draw()

    def _draw(self) -> None:
        self._progress.update(self._task, completed=self._step, status=self._status)
        self._progress.refresh()
        self._refreshed = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        self._progress.update(self._task, completed=self._step, status=self._status)
        self._progress.stop()
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _json_number(value: Any) -> Any:
    """``None`` for NaN and infinities (JSON has no such numbers), the value otherwise."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
