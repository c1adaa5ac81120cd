"""A Weights & Biases run (``trainer.loggers: [wandb]``, options in ``trainer.wandb``).

In ``offline`` mode (the default) nothing leaves the machine: the run is written under
``<results_dir>/wandb/offline-run-*`` and ``wandb sync`` uploads it later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import wandb

from litegen.config.training import WandbConfig
from litegen.loggers.conventions import scalar_tag


class WandbSink:
    """Example::

    sink = WandbSink(Path("results/dit"), "dit", WandbConfig()); sink.scalars(1, {"loss": 0.5})
    """

    def __init__(
        self, folder: Path, run_name: str, cfg: WandbConfig, run_config: dict[str, Any] | None
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project or run_name,
            name=run_name,
            mode=cfg.mode,
            dir=str(folder),
            config=run_config,
        )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({scalar_tag(key): value for key, value in values.items()}, step=step)

    def media(self, step: int, files: list[Path]) -> None:
        logged = {}
        for path in files:
            suffix = path.suffix.lower()
            if suffix in (".gif", ".mp4"):
                logged[f"samples/{path.stem}"] = wandb.Video(str(path), format=suffix[1:])
            else:
                logged[f"samples/{path.stem}"] = wandb.Image(str(path))
        self.run.log(logged, step=step)

    def close(self) -> None:
        self.run.finish()


__all__ = ["WandbSink"]
