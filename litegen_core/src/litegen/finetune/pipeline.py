"""The pipeline folder a fine-tuning run trains: where it is, its family, its transformer and
the objective its scheduler samples with. Torch is imported on first use (the checks before
launch need none).

Example::

    folder = pipeline_folder(config)          # config.finetune.pipeline, checked
    family = pipeline_family(config)          # a litegen.families.Family of its scheduler
    model = load_transformer(config)          # on meta when runtime.device is "meta"
"""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from litegen.families import Family, family_for_pipeline
from litegen.pretrained import check_pipeline_folder, load_component, load_pipeline

if TYPE_CHECKING:
    import torch

    from litegen.objectives import FlowMatching


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def settings(config: Any) -> Any:
    """The ``finetune`` section; ValueError naming the fix when the config has none."""
    section = config.get("finetune")
    if section is None:
        raise ValueError(
            "the config has no finetune section: give finetune.pipeline and "
            "finetune.data.folder (recipes/finetune_video.yaml, docs/finetune.md)."
        )
    return section


def pipeline_folder(config: Any) -> Path:
    """``finetune.pipeline``, checked to be a pipeline folder with every component."""
    folder = settings(config).pipeline
    if not folder:
        raise ValueError(
            "finetune.pipeline is not set: give the diffusers pipeline folder to fine-tune "
            "(python -m litegen_zoo.make_tiny_pipeline wan DIR writes a tiny one)."
        )
    check_pipeline_folder(folder)
    return Path(folder)


def pipeline_family(config: Any) -> Family:
    """The family of the pipeline folder, with its scheduler config; ValueError naming the
    families that exist when none trains its pipeline class."""
    folder = pipeline_folder(config)
    model_index = read_json(folder / "model_index.json")
    pipeline_class = model_index.get("_class_name", "?")
    try:
        family = family_for_pipeline(pipeline_class, model_index)
    except ValueError as err:
        raise ValueError(f"finetune.pipeline {folder} is a {pipeline_class}: {err}") from None
    return family(read_json(folder / "scheduler" / "scheduler_config.json"))


def make_objective(config: Any) -> FlowMatching:
    """Flow matching with the scheduler's shift and ``finetune.objective``'s settings."""
    from litegen.objectives import FlowMatching

    folder = pipeline_folder(config)
    options = {k: v for k, v in settings(config).objective.to_dict().items() if v is not None}
    scheduler = read_json(folder / "scheduler" / "scheduler_config.json")
    return FlowMatching.from_scheduler_config(scheduler, **options)


def load_transformer(config: Any) -> torch.nn.Module:
    """The pipeline's transformer; on the meta device when ``runtime.device`` is ``meta``
    (``litegen inspect-config --estimate``): built from its ``config.json``, no weights read."""
    import torch

    folder = pipeline_folder(config)
    if config.runtime.device != "meta":
        return load_component(folder, "transformer")
    library, class_name = check_pipeline_folder(folder)["transformer"]
    cls = getattr(importlib.import_module(library), class_name)
    with torch.device("meta"):
        return cls.from_config(cls.load_config(folder / "transformer"))


@contextlib.contextmanager
def _no_loading_bars() -> Any:
    """diffusers' and transformers' per-component loading bars off: every rank would draw them."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        diffusers_logging.enable_progress_bar()
        transformers_logging.enable_progress_bar()


def frozen_pipeline(config: Any, **kwargs: Any) -> Any:
    """The pipeline without its transformer, every component frozen (to encode and sample);
    ``kwargs`` go to ``from_pretrained`` (``torch_dtype``)."""
    folder = pipeline_folder(config)
    # Every transformer stays out (Wan 2.2's second expert too): training brings its own.
    transformers = {
        name: None for name in check_pipeline_folder(folder) if name.startswith("transformer")
    }
    unloaded = {name: None for name in pipeline_family(config).unloaded_components}
    with _no_loading_bars():
        return load_pipeline(
            folder, trained=(), **{"transformer": None, **transformers, **unloaded, **kwargs}
        )


__all__ = [
    "frozen_pipeline",
    "load_transformer",
    "make_objective",
    "pipeline_family",
    "pipeline_folder",
    "read_json",
    "settings",
]
