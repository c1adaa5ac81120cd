"""What a fine-tuning recipe's inputs get wrong, found before any rank starts.

The pipeline folder (its components, a family that trains its pipeline class), the
``finetune.data`` settings the family cannot use (an image family's frame settings, a frame
count off the VAE's rule), the validation's condition files (one per prompt, of a condition the
family takes) and the media folder at the global batch size (its condition files included), from a scan that reads
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
from pathlib import Path
from typing import Any

from litegen.families import Family
from litegen.finetune.media import media_problems
from litegen.finetune.pipeline import pipeline_family, settings

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


def validation_problems(config: Any, family: Family) -> list[str]:
    """What ``trainer.validation.conditions`` gets wrong for this family: a condition it does
    not take, a count other than one file per prompt, a file that is not there, or a
    condition it cannot sample without, while samples are drawn."""
    validation = config.trainer.validation
    given, taken = validation.conditions, family.media_conditions
    problems = []
    for name, paths in sorted(given.items()):
        if name not in taken:
            takes = ", ".join(sorted(taken)) or "none"
            problems.append(
                f"field 'trainer.validation.conditions.{name}': {family.pipeline_class} does "
                f"not take a {name} condition (it takes: {takes}); remove it."
            )
            continue
        if len(paths) != len(validation.prompts):
            problems.append(
                f"field 'trainer.validation.conditions.{name}': {len(paths)} file(s) for "
                f"{len(validation.prompts)} prompt(s); give one file per prompt, in order."
            )
        problems += [
            f"field 'trainer.validation.conditions.{name}': {path} does not exist."
            for path in paths
            if not Path(path).is_file()
        ]
    if config.trainer.sample_every and validation.prompts:
        for name, condition in sorted(taken.items()):
            if name not in given and not condition.optional:
                problems.append(
                    f"field 'trainer.validation.conditions.{name}': {family.pipeline_class} "
                    f"samples with its {name} condition ({condition.description}); give one file per "
                    "prompt, or set trainer.sample_every=0."
                )
    return problems


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
        problems += validation_problems(config, family)
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


__all__ = ["check_inputs", "validation_problems"]
