"""What a fine-tuning recipe's inputs get wrong, found before any rank starts.

The pipeline folder (its components, a family that trains its pipeline class), the
``finetune.data`` settings the family cannot use (an image family's frame settings, a frame
count off the VAE's rule) and the media folder at the global batch size, from a scan that reads
sizes and lengths and encodes nothing. Every problem is listed in one ``ValueError``; the files
that can never be drawn are logged as a warning.

Example::

    check_inputs(config)   # litegen.entry.check_inputs calls it through litegen.finetune
"""

from __future__ import annotations

import logging
import os
from typing import Any

from litegen.finetune.media import media_problems
from litegen.finetune.pipeline import pipeline_family, settings

log = logging.getLogger("litegen")


def check_inputs(config: Any) -> None:
    """Raise one ``ValueError`` listing every problem of the fine-tuning inputs."""
    settings(config)
    problems: list[str] = []
    family = None
    try:
        family = pipeline_family(config)
    except ValueError as err:
        problems.append(str(err))
    if not settings(config).data.folder:
        problems.append(
            "finetune.data.folder is not set: give the folder of images and videos with "
            "captions (docs/finetune.md#media-folders)."
        )
    elif family is not None:
        errors, warnings = media_problems(config, family)
        problems += errors
        if os.environ.get("RANK", "0") == "0":  # said once: by the launcher, then rank 0
            for line in warnings:
                log.warning(line)
    if problems:
        raise ValueError("\n".join(problems))


__all__ = ["check_inputs"]
