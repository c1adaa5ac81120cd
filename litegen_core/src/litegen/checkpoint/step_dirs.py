"""Run checkpoint folders on disk: their names, the newest complete one, and the checks made
before one is loaded (markers, required files, the manifest's sizes, DCP's metadata).

The names and the layout are declared in :mod:`litegen.checkpoint.layout`. Torch-free at import
(reading DCP's metadata imports torch then).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import yaml

from litegen.checkpoint.layout import (
    COMPLETE,
    CONFIG,
    DCP_METADATA,
    LATEST,
    MODEL_DIR_GLOB,
    REQUIRED_FILES,
    TRAINER_DIR,
    step_of,
)
from litegen.checkpoint.manifest import manifest_files, size_problems, summarize


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest step first.

    Example:
        >>> for step in (500, 1000):
        ...     Path(f"results/dit/step_{step}").mkdir(parents=True)
        ...     Path(f"results/dit/step_{step}/COMPLETE").touch()
        >>> list_checkpoints("results/dit")
        [(500, PosixPath('results/dit/step_500')), (1000, PosixPath('results/dit/step_1000'))]
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = step_of(child)
        if step is not None and (child / COMPLETE).is_file():
            found.append((step, child))
    return sorted(found)


def newer_checkpoints(root: str | Path, step: int) -> list[Path]:
    """The complete checkpoints under ``root`` past ``step``, oldest first: what a run that
    continues from ``step`` in ``root`` would replace.

    Example:
        >>> for step in (500, 1000):
        ...     Path(f"results/dit/step_{step}").mkdir(parents=True)
        ...     Path(f"results/dit/step_{step}/COMPLETE").touch()
        >>> newer_checkpoints("results/dit", 500)
        [PosixPath('results/dit/step_1000')]
    """
    return [path for saved, path in list_checkpoints(root) if saved > step]


def find_latest(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, or the newest complete one when the pointer is unusable.

    The pointer wins over "highest step" because a run resumed from an earlier step writes
    lower steps than an abandoned later checkpoint that may still sit in the folder.
    """
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text(encoding="utf-8").strip()
        if target.name and (target / COMPLETE).is_file():
            return target
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """Validate a run checkpoint: a ``step_<N>`` folder, or a checkpoint_dir (its latest one).

    Raises ``FileNotFoundError`` or ``ValueError`` naming the path and what is wrong; reads only.

    Example::

        resolve_checkpoint("results/dit")
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"run checkpoint {path} does not exist; pass a step_<N> folder written by the "
            f"training loop, or the checkpoint_dir that holds them (cwd: {Path.cwd()})."
        )
    if not path.is_dir():
        raise ValueError(f"run checkpoint {path} is a file; pass a step_<N> folder instead.")
    if not (path / COMPLETE).is_file() and not (path / TRAINER_DIR).is_dir():
        latest = find_latest(path)
        if latest is None:
            raise FileNotFoundError(
                f"{path} holds no complete run checkpoint (no step_<N> folder with a {COMPLETE} "
                "marker); set trainer.checkpoint_every to write some."
            )
        path = latest
    if not (path / COMPLETE).is_file():
        raise ValueError(
            f"run checkpoint {path} is partial: it has no {COMPLETE} marker (the save was "
            "interrupted). Resume from an earlier step_<N> folder or the checkpoint_dir's latest."
        )
    for required in REQUIRED_FILES:
        if not (path / required).is_file():
            raise ValueError(f"run checkpoint {path} is corrupt: {required} is missing.")
    manifest = manifest_files(path)
    if manifest is not None:
        problems = size_problems(path, manifest)
        if problems:
            raise ValueError(
                f"run checkpoint {path} is corrupt: {summarize(problems)}. Resume from another "
                "step_<N> folder."
            )
    for model_dir in sorted(path.glob(MODEL_DIR_GLOB)):
        read_metadata(model_dir)  # raises on a truncated or foreign file
    return path


def read_metadata(model_dir: Path) -> Any:
    """DCP's ``.metadata`` of one model folder, built from DCP's metadata classes alone (a
    crafted file never runs code); ValueError naming the file when unreadable or refused."""
    from litegen.checkpoint.dcp_reader import read_dcp_metadata

    try:
        return read_dcp_metadata(model_dir / DCP_METADATA)
    except ValueError as err:
        raise ValueError(f"run checkpoint {model_dir.parent} is refused: {err}") from err
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError) as err:
        raise ValueError(
            f"run checkpoint {model_dir.parent} is corrupt: {model_dir / DCP_METADATA} cannot be "
            f"read ({type(err).__name__}: {err})."
        ) from err


def read_config_text(path: Path, name: str = CONFIG, *, optional: bool = False) -> dict[str, Any]:
    """A YAML mapping a checkpoint folder holds (by default the config it was saved with).

    ``optional``: a missing or empty file reads as ``{}`` instead of raising.

    Example:
        >>> Path("step_10").mkdir()
        >>> _ = Path("step_10/config.yaml").write_text("max_steps: 100\\n")
        >>> read_config_text(Path("step_10")), read_config_text(Path("step_10"), "launch.yaml", optional=True)
        ({'max_steps': 100}, {})
    """
    file = Path(path) / name
    if optional and not file.is_file():
        return {}
    data = yaml.safe_load(file.read_text(encoding="utf-8"))
    if optional and data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"run checkpoint {path} is corrupt: {name} is not a mapping.")
    return data
