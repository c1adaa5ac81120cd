"""What a fine-tuning recipe's inputs get wrong, found before any rank starts.

The pipeline folder (its components, a family that trains its pipeline class), the
``finetune.data`` settings the family cannot use (an image family's frame settings, a frame
count off the VAE's rule) and the media folder at the global batch size, from a scan that reads
sizes and lengths and encodes nothing. Every problem is listed in one ``ValueError``; the files
that can never be drawn are logged as a warning, by the launcher (inside a rank, where the
launcher already checked, the scan is quiet).

Example::

    check_inputs(config)   # litegen.entry.check_inputs calls it through litegen.finetune
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from litegen.finetune.experts import expert_problems
from litegen.finetune.media import media_problems
from litegen.finetune.pipeline import pipeline_family, pipeline_folder, read_json, settings

log = logging.getLogger("litegen")


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """The scan's log lines off: the dataset's own scan says them again right after."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_inputs(config: Any) -> None:
    """Raise one ``ValueError`` listing every problem of the fine-tuning inputs."""
    settings(config)
    problems: list[str] = []
    family = None
    try:
        family = pipeline_family(config)
    except ValueError as err:
        problems.append(str(err))
    if family is not None:
        problems += expert_problems(config, read_json(pipeline_folder(config) / "model_index.json"))
    if not settings(config).data.folder:
        problems.append(
            "finetune.data.folder is not set: give the folder of images and videos with "
            "captions (docs/finetune.md#media-folders)."
        )
    elif family is not None:
        in_rank = "RANK" in os.environ  # the launcher checked and said it all already
        with _quiet(log) if in_rank else contextlib.nullcontext():
            errors, warnings = media_problems(config, family)
        problems += errors
        for line in [] if in_rank else warnings:
            log.warning(line)
    if problems:
        raise ValueError("\n".join(problems))


__all__ = ["check_inputs"]
