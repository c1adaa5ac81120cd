"""Loading a run checkpoint folder: every file checked against the manifest, every model against
DCP's metadata, before anything is loaded in place; then this rank's trainer state.

Example::

    load_run_checkpoint("results/dit/step_500", gen.checkpointer.trainables)["step"]
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from litegen.checkpoint.files import check_model_state
from litegen.checkpoint.layout import (
    MANIFEST,
    MODEL_DIR_GLOB,
    RANK_FILE_GLOB,
    TRAINER_DIR,
    model_dir_name,
    rank_file,
)
from litegen.checkpoint.manifest import digest_problems, manifest_files, share_of, summarize
from litegen.checkpoint.step_dirs import read_metadata, resolve_checkpoint
from litegen.checkpoint.trainable import Trainable

log = logging.getLogger("litegen")


def load_run_checkpoint(
    path: str | Path, trainables: Callable[[], list[Trainable]]
) -> dict[str, Any]:
    """Validate ``path``, load weights/optimizer/EMA of what ``trainables`` returns in place,
    return this rank's trainer state. Call on every rank.

    Shapes are checked against DCP's metadata before anything is loaded, so a mismatching
    model raises a ValueError naming the checkpoint and every differing tensor.
    """
    path = resolve_checkpoint(path)
    verify_digests(path)
    targets = trainables()
    saved = len(list(path.glob(MODEL_DIR_GLOB)))
    if saved != len(targets):
        raise ValueError(
            f"run checkpoint {path} holds {saved} trainable model(s), this run prepares "
            f"{len(targets)}; resume with the entry module that wrote it."
        )
    for i, target in enumerate(targets):
        check_model_dir(path / model_dir_name(i), target)
    from torch.distributed.checkpoint.api import CheckpointException

    for i, target in enumerate(targets):
        try:
            target.load(path / model_dir_name(i))
        # DCP gathers every rank's read error into a CheckpointException, a BaseException.
        except (Exception, CheckpointException) as err:
            raise ValueError(
                f"run checkpoint {path} is corrupt: loading {path / model_dir_name(i)} failed "
                f"({_one_line(err)})."
            ) from err
    saved_ranks = len(list((path / TRAINER_DIR).glob(RANK_FILE_GLOB)))
    # At another world size rank r takes rank r % saved's state (see docs/resume.md).
    state_file = path / rank_file(dist.get_rank() % max(saved_ranks, 1))
    try:
        return torch.load(state_file, map_location="cpu", weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
        raise ValueError(
            f"run checkpoint {path} is corrupt: {state_file} cannot be read "
            f"({type(err).__name__}: {err})."
        ) from err


def verify_digests(path: Path) -> None:
    """Every rank hashes its share of the files; any mismatch raises on every rank."""
    manifest = manifest_files(path)
    if manifest is None:
        if dist.get_rank() == 0:
            log.warning(
                "run checkpoint %s has no %s (it was written by an older LiteGen), so its "
                "files cannot be verified; loading it as it is.",
                path,
                MANIFEST,
            )
        return
    mine = share_of(manifest, dist.get_rank(), dist.get_world_size())
    found: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, digest_problems(path, manifest, mine))
    problems = [line for part in found for line in part or []]
    if problems:
        raise ValueError(
            f"run checkpoint {path} is corrupt: {summarize(problems)}. Resume from another "
            "step_<N> folder."
        )


def check_model_dir(model_dir: Path, target: Trainable) -> None:
    """The DCP folder ``model_dir`` holds ``target``'s tensors at their shapes, and its
    optimizer's and EMA's state when ``target`` has them; ValueError naming what differs."""
    metadata = read_metadata(model_dir).state_dict_metadata
    expected = target.model_shapes()
    saved = {
        key.removeprefix("model."): torch.empty(tuple(meta.size), device="meta")
        for key, meta in metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    check_model_state(expected, saved, model_dir.parent)
    if target.optimizer is not None and not any(k.startswith("optimizer.") for k in metadata):
        raise ValueError(f"run checkpoint {model_dir.parent} has no optimizer state.")
    if target.ema is not None and not any(k.startswith("ema.") for k in metadata):
        raise ValueError(
            f"run checkpoint {model_dir.parent} has no EMA state but ema.enable is true; "
            "resume with ema.enable=false or from a run that kept an EMA."
        )


def _one_line(err: BaseException) -> str:
    """``Type: first line`` of an error; for DCP's CheckpointException, of the first rank's."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {_one_line(cause)}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"
