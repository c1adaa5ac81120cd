"""Where training metrics go: JSON lines always, TensorBoard when installed, a rich bar on rank 0."""

from __future__ import annotations

import json
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


def _keep_records_up_to(path: Path, step: int) -> None:
    """Drop records past ``step``: a resumed run rewrites those steps, a fresh one all of them."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(kept))


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
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=self._total, completed=self._start, status=""
        )
        return self

    def log(self, step: int, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self._tensorboard.add_scalar(f"train/{key}", value, step)
        status = "  ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()
        )
        self._progress.update(self._task, completed=step, status=status)

    def advance(self, step: int) -> None:
        if self.enabled:
            self._progress.update(self._task, completed=step)

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        self._progress.stop()
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
