"""Where metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases (``trainer.loggers``).

``metrics.jsonl`` is always written and is the source of truth
(:class:`litegen.instruments.metrics.MetricsLogger`); each logger named in ``trainer.loggers`` gets
the same scalars, and the sample images and videos (PNG, GIF) the ``sample`` hook produced.
Rank 0 alone opens them.

Example:
    >>> check_loggers(["jsonl", "tensorboard"])  # raises a ValueError naming the extra if missing
    >>> sinks = open_sinks(["tensorboard"], Path("results/dit"), run_name="dit")
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Protocol

from litegen.config.training import WandbConfig
from litegen.loggers.conventions import scalar_tag

# The package each logger imports, and the extra that installs it.
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Sink(Protocol):
    """One destination of the training metrics."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def media(self, step: int, files: list[Path]) -> None: ...

    def close(self) -> None: ...


def check_loggers(names: list[str]) -> None:
    """Raise ``ValueError`` naming the extra to install for a logger whose package is missing."""
    for name in names:
        package = _PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"trainer.loggers has {name}, but the {package} package is not installed; "
                f"install the extra (pip install 'litegen-core[{name}]', or uv sync --extra "
                f"{name}) or remove {name} from trainer.loggers."
            )


def open_sinks(
    names: list[str],
    folder: Path,
    *,
    run_name: str,
    wandb: WandbConfig | None = None,
    run_config: dict[str, Any] | None = None,
) -> list[Sink]:
    """The sinks ``names`` asks for ("jsonl" is the metrics file itself: no sink)."""
    check_loggers(names)
    sinks: list[Sink] = []
    if "tensorboard" in names:
        from litegen.loggers.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(folder / "tensorboard"))
    if "wandb" in names:
        from litegen.loggers.wandb import WandbSink

        sinks.append(WandbSink(folder, run_name, wandb or WandbConfig(), run_config))
    return sinks


__all__ = ["Sink", "check_loggers", "open_sinks", "scalar_tag"]
