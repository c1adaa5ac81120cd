"""Where training metrics go: ``metrics.jsonl`` always, the loggers asked for, progress on stdout.

Rank 0 alone writes. ``metrics.jsonl`` is the source of truth; TensorBoard and Weights & Biases
(``trainer.loggers``, :mod:`litegen.loggers`) get the same scalars and the sample files.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from litegen.checkpoint.atomic import atomic_write_text
from litegen.checkpoint.layout import METRICS
from litegen.config.training import WandbConfig
from litegen.loggers import Sink, open_sinks
from litegen.loggers.progress import ProgressBar, ProgressLines, progress_display, status_of


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
    """Writes one JSON object per logged step to ``metrics.jsonl`` and to the loggers (rank 0).

    Example:
        >>> with MetricsLogger("results/run", total_steps=100, enabled=True,
        ...                    loggers=["tensorboard"]) as metrics:
        ...     metrics.log(step=1, loss=0.5)
        step 1/100  loss 0.5  eta ...
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        total_steps: int,
        enabled: bool,
        start_step: int = 0,
        loggers: Sequence[str] = ("jsonl",),
        run_name: str = "run",
        wandb: WandbConfig | None = None,
        run_config: dict[str, Any] | None = None,
        console: Console | None = None,
    ):
        self.enabled = enabled
        self.folder = Path(folder)
        self._loggers = list(loggers)
        self._sink_options = {"run_name": run_name, "wandb": wandb, "run_config": run_config}
        self._console = console
        self._file = None
        self._sinks: list[Sink] = []
        self._display: ProgressBar | ProgressLines | None = None
        self._total = total_steps
        self._start = start_step

    def __enter__(self) -> MetricsLogger:
        if not self.enabled:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / METRICS
        _keep_records_up_to(path, self._start)
        self._file = open(path, "a", encoding="utf-8")
        self._sinks = open_sinks(self._loggers, self.folder, **self._sink_options)
        self._display = progress_display(self._total, self._start, self._console)
        return self

    def log(
        self, step: int, when: float | None = None, media: Sequence[Path] = (), **values: Any
    ) -> None:
        """Write one record: ``step``, ``time`` (``when``, else now) and ``values``; the
        loggers also get ``media`` (PNG and GIF files of samples).

        Non-finite floats are written as ``null``, so every line stays strict JSON.
        """
        if not self.enabled:
            return
        record = {"step": step, "time": time.time() if when is None else when}
        record.update((k, _json_number(v)) for k, v in values.items())
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in values.items() if isinstance(v, int | float)}
        for sink in self._sinks:
            if media:
                sink.media(step, list(media))
            sink.scalars(step, scalars)
        self._display.record(step, status_of(values))

    def advance(self, step: int) -> None:
        """Move the progress bar to ``step`` (drawn if the last drawing is old enough)."""
        if self._display is not None:
            self._display.advance(step)

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        self._display.close()
        self._file.close()
        for sink in self._sinks:
            sink.close()


def _json_number(value: Any) -> Any:
    """``None`` for NaN and infinities (JSON has no such numbers), the value otherwise."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
