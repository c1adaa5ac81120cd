"""The names of a run's files and folders, declared once for the core and the CLI. Torch-free.

Layout of a run's ``checkpoint_dir`` (by default its ``results_dir``)::

    step_<N>/
        model_<i>/            DCP folder of trainable model i: weights, optimizer, EMA (reshards)
        trainer/rank_<r>.pt   step, sampler cursor, LR schedulers, RNG states of rank r
        config.yaml           the resolved config of the run
        launch.yaml           how `litegen launch` started it (entry, ranks), when known
        MANIFEST.json         size and BLAKE2b digest of every file above (checkpoint/manifest.py)
        COMPLETE              written last: a folder without it is never loaded
    latest                    name of the newest complete step folder, updated after the rename
    .step_<N>.tmp-<id>/       a save in progress, or one killed midway: never read, removed later
    <exp_name>[_step<N>].pth  the files of save_model, save_optimizer, save_ema (KIND_SUFFIXES)

    <exp_name>*.lora.safetensors, <exp_name>*.peft/   a LoRA run's adapters (save_model, peft)

and in the ``results_dir``: ``metrics.jsonl``, ``recipe.resolved.yaml`` (what `litegen launch`
ran), ``samples/step_<N>/``, ``profile/`` and the folders written at the end of a run
(``END_OF_RUN_DIRS``: ``save_diffusers``' folder, the fine-tuning recipes' exports).

Example:
    >>> step_dir_name(10), step_of("results/dit/step_10")
    ('step_10', 10)
"""

from __future__ import annotations

import glob
import os
import re
import uuid
from pathlib import Path
from typing import Literal

COMPLETE = "COMPLETE"
LATEST = "latest"
MANIFEST = "MANIFEST.json"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
LAUNCH = "launch.yaml"
TRAINER_DIR = "trainer"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's own index file in a DCP folder
STEP_DIR_GLOB = "step_*"
MODEL_DIR_GLOB = "model_*"
RANK_FILE_GLOB = "rank_*.pt"  # in TRAINER_DIR
RESOLVED_RECIPE = "recipe.resolved.yaml"
SAMPLES_DIR = "samples"  # <results_dir>/samples/step_<N>/: validation samples of step N
PROFILE_DIR = "profile"
# Written once at the end of a run into the results_dir: save_diffusers' folder, and the
# fine-tuning recipes' pipeline folder (full fine-tuning) or LoRA export.
DIFFUSERS_DIR = "diffusers"
END_OF_RUN_DIRS = (DIFFUSERS_DIR, "pipeline", "lora")
_STEP_DIR = re.compile(r"^step_(\d+)$")
LEFTOVER = re.compile(r"^\.step_\d+\.(tmp|old)-")

Kind = Literal["model", "optimizer", "ema", "lora", "ema_lora"]
# The single files the LiteGen object writes: kind -> the suffix after ``<exp_name>[_step<N>]``.
# The suffix also picks the file's format (litegen.checkpoint.formats).
KIND_SUFFIXES: dict[str, str] = {
    "model": ".pth",
    "optimizer": ".optim_state.pth",
    "ema": ".ema.pth",
    # The adapters of a LoRA run (litegen.lora), in place of the model and EMA files.
    "lora": ".lora.safetensors",
    "ema_lora": ".ema.lora.safetensors",
}


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` optimizer steps.

    >>> step_dir_name(10)
    'step_10'
    """
    return f"step_{step}"


def step_of(step_dir: str | Path) -> int | None:
    """The step a ``step_<N>`` folder holds (None for any other name).

    >>> step_of("step_20"), step_of("latest")
    (20, None)
    """
    match = _STEP_DIR.match(Path(step_dir).name)
    return int(match.group(1)) if match else None


def temporary_step_dir_name(step: int) -> str:
    """A fresh name for the folder a save of ``step`` is written into (matches ``LEFTOVER``).

    >>> bool(LEFTOVER.match(temporary_step_dir_name(3)))
    True
    """
    return f".step_{step}.tmp-{uuid.uuid4().hex[:8]}"


def model_dir_name(index: int) -> str:
    """The DCP folder of trainable model ``index`` in a step folder.

    >>> model_dir_name(0)
    'model_0'
    """
    return f"model_{index}"


def rank_file(rank: int) -> str:
    """The trainer state of ``rank``, relative to its step folder.

    >>> rank_file(1)
    'trainer/rank_1.pt'
    """
    return f"{TRAINER_DIR}/rank_{rank}.pt"


# What a step folder must hold to be loaded at all.
REQUIRED_FILES = (CONFIG, rank_file(0), f"{model_dir_name(0)}/{DCP_METADATA}")


def step_in_name(name: str, exp_name: str) -> int | None:
    """The step of a file ``save_model(step=N)`` and its kin named (``<exp_name>_step<N>.*``).

    >>> step_in_name("dit_step20.ema.pth", "dit"), step_in_name("dit.pth", "dit")
    (20, None)
    """
    match = re.match(rf"{re.escape(exp_name)}_step(\d+)\.", name)
    return int(match.group(1)) if match else None


def final_weights_glob(exp_name: str) -> str:
    """The glob of the model files ``save_model`` writes by default for ``exp_name``.

    >>> final_weights_glob("dit")
    'dit*.pth'
    """
    return f"{glob.escape(exp_name)}*{KIND_SUFFIXES['model']}"


def check_file_name(value: str, field: str) -> str:
    """``value`` when it can name a file inside a run's folder; a ValueError naming ``field``
    and the fix when it would lead elsewhere (a path separator, ``.`` or ``..``) or is empty.

    Names from a config (``exp_name``) become file and folder names (``<exp_name>.pth``,
    ``results/<exp_name>``); a separator in one would write outside the run's folder.

    Example:
        >>> check_file_name("dit_xl-256", "exp_name")
        'dit_xl-256'
        >>> check_file_name("../elsewhere", "exp_name")
        Traceback (most recent call last):
        ...
        ValueError: exp_name '../elsewhere' cannot name a file: it holds a path separator. ...
    """
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if not value or not value.strip():
        problem = "is empty"
    elif any(sep in value for sep in separators):
        problem = "holds a path separator"
    elif value in (".", ".."):
        problem = "names a folder, not a file"
    elif "\0" in value:
        problem = "holds a NUL character"
    else:
        return value
    raise ValueError(
        f"{field} {value!r} cannot name a file: it {problem}. Use a plain name such as "
        "'dit_xl' (letters, digits, '-', '_', '.'); choose folders with results_dir and "
        "checkpoint_dir."
    )
