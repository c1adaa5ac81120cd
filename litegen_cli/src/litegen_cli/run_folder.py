"""One run per folder: ``launch`` refuses a folder that holds another run, ``--overwrite`` moves
that run aside (never deletes it), and a lock keeps two live runs out of one folder.

A run's folders are its ``results_dir`` and, when it lies elsewhere, its ``checkpoint_dir``.
Another run is there when they hold run checkpoints (``step_<N>``, ``latest``), a
``metrics.jsonl`` with records, or final weights (``<exp_name>*.pth``).

The lock is ``.litegen.lock`` in each folder (:mod:`litegen_cli.run_lock`).

On a multi-node job only node 0 checks, locks and moves the folders: the others share them
(their ranks write checkpoints there, so the file system must be shared) and write nothing
there before the ranks start. Torch-free.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from litegen.checkpoint.layout import (
    END_OF_RUN_DIRS,
    LATEST,
    METRICS,
    PROFILE_DIR,
    RESOLVED_RECIPE,
    SAMPLES_DIR,
    STEP_DIR_GLOB,
    check_file_name,
    final_weights_glob,
    step_in_name,
    step_of,
)
from litegen.checkpoint.step_dirs import newer_checkpoints
from litegen_cli.run_lock import RunFolderError, RunLock, in_use, live_holder


def run_folders(config: Any) -> list[Path]:
    """The folders a run writes: results_dir, and checkpoint_dir when it lies outside it.

    >>> from litegen.config import MainConfig
    >>> run_folders(MainConfig(results_dir="/r", checkpoint_dir="/c"))
    [PosixPath('/r'), PosixPath('/c')]
    """
    results = Path(config.get_results_dir()).absolute()
    checkpoints = Path(config.get_checkpoint_dir()).absolute()
    return [results] if checkpoints.is_relative_to(results) else [results, checkpoints]


def earlier_run(config: Any) -> list[str]:
    """What of another run the folders hold, one line per kind (empty: nothing).

    Example:
        >>> from litegen.config import MainConfig
        >>> config = MainConfig(results_dir="r")
        >>> earlier_run(config)
        []
        >>> Path("r").mkdir()
        >>> _ = Path("r/metrics.jsonl").write_text('{"step": 1}\\n')
        >>> earlier_run(config)
        ['.../r/metrics.jsonl (1 record(s))']
    """
    found = []
    checkpoints = Path(config.get_checkpoint_dir()).absolute()
    steps = sorted(checkpoints.glob(STEP_DIR_GLOB)) if checkpoints.is_dir() else []
    latest = checkpoints / LATEST
    if steps or latest.is_file():
        pointer = latest.read_text(encoding="utf-8").strip() if latest.is_file() else "none"
        found.append(f"{len(steps)} run checkpoint(s) in {checkpoints} (latest: {pointer})")
    metrics = Path(config.get_results_dir()).absolute() / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        with open(metrics, "rb") as handle:
            records = sum(1 for line in handle if line.strip())
        found.append(f"{metrics} ({records} record(s))")
    weights = sorted(checkpoints.glob(final_weights_glob(config.exp_name)))
    if weights:
        found.append(f"final weights {', '.join(p.name for p in weights)} in {checkpoints}")
    return found


@contextmanager
def claim_run_folder(
    config: Any,
    *,
    node_rank: int = 0,
    overwrite: bool = False,
    continuing: bool = False,
    resumes: Path | None = None,
    move_newer_aside: bool = False,
) -> Iterator[list[str]]:
    """Own the run's folders while the block runs; yields lines to show (a run moved aside).

    ``continuing``: the run goes on from a checkpoint in these folders (``resume``,
    ``auto_resume``), so an earlier run there is expected. ``resumes``: the ``step_<N>`` folder
    the run continues from; checkpoints past it in the run's checkpoint_dir are refused (the run
    would replace them) unless ``move_newer_aside``. Raises :class:`RunFolderError` before
    anything is written when the folders are in use or hold another run.

    Example:
        >>> from litegen.config import MainConfig
        >>> with claim_run_folder(MainConfig(results_dir="r"), overwrite=True) as notes:
        ...     notes  # nothing was there to move aside
        []
    """
    try:
        check_file_name(config.exp_name, "exp_name")
    except ValueError as err:
        raise RunFolderError("Invalid run name", [str(err)]) from None
    if node_rank != 0:
        yield []
        return
    folders = run_folders(config)
    for folder in folders:
        holder = live_holder(folder)
        if holder is not None:
            raise in_use(folder, holder)
    found = [] if continuing else earlier_run(config)
    if found and not overwrite:
        raise _holds_a_run(config, folders, found)
    notes = []
    if found:
        for folder in folders:
            if folder.exists():
                notes.append(f"Moved the earlier run in {folder} to {move_aside(folder)}.")
    with ExitStack() as stack:
        for folder in folders:
            stack.enter_context(RunLock(folder))
        found = [] if continuing else earlier_run(config)
        if found:  # another run started and ended between the check and the lock
            raise _holds_a_run(config, folders, found)
        if resumes is not None:
            notes += _keep_newer_steps(config, resumes, move_newer_aside)
        yield notes


def move_aside(folder: Path) -> Path:
    """Rename ``folder`` to ``<folder>.old-<date>-<time>`` (locked meanwhile); the new name.

    >>> Path("results/dit").mkdir(parents=True)
    >>> move_aside(Path("results/dit"))
    PosixPath('results/dit.old-...')
    """
    target = _aside_name(folder)
    with RunLock(folder) as lock:  # no live run may write there while it moves
        os.rename(folder, target)
        lock.moved_to(target)
    return target


def _aside_name(folder: Path) -> Path:
    """``<folder>.old-<date>-<time>``, numbered when taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder.with_name(f"{folder.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.old-{stamp}-{n}")
    return target


def _keep_newer_steps(config: Any, resumes: Path, move: bool) -> list[str]:
    """Refuse a resume that would replace newer checkpoints, or move them aside with every
    output of the newer run the continued one would write again (:func:`_newer_outputs`), and
    copies of what it rewrites in place (metrics.jsonl, whose later records it drops,
    ``latest`` and the resolved recipe)."""
    checkpoints = Path(config.get_checkpoint_dir()).absolute()
    step = step_of(resumes)
    newer = newer_checkpoints(checkpoints, step) if step is not None else []
    names = ", ".join(path.name for path in newer)
    if newer and not move:
        raise RunFolderError(
            "Newer checkpoints would be replaced",
            [
                f"{checkpoints} holds checkpoints newer than {resumes.name}: {names}.",
                "Continuing from an older step there would replace them. Either",
                f"  branch into a new folder:   litegen resume --from {resumes} "
                "--branch <new folder>",
                "  or move the newer aside:    add --move-newer-aside (they and the newer "
                f"run's outputs move to {checkpoints.name}.old-<time>/ beside it, nothing is "
                "deleted)",
            ],
        )
    if not newer:
        return []
    aside = _aside_name(checkpoints)
    aside.mkdir()
    moved = []
    for folder, path in _newer_outputs(config, step):
        target = aside / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, target)  # into the fresh aside folder: nothing is overwritten
        moved.append(path.relative_to(folder).as_posix())
    # What the continued run rewrites in place: a copy keeps the newer run's version.
    results = Path(config.get_results_dir()).absolute()
    for path in (results / METRICS, checkpoints / LATEST, results / RESOLVED_RECIPE):
        if path.is_file() and not (aside / path.name).exists():
            shutil.copy2(path, aside / path.name)
    others = sorted(set(moved) - {path.name for path in newer})
    with_them = f" With them: {', '.join(others)}." if others else ""
    return [f"Moved {names} (newer than {resumes.name}) aside to {aside}.{with_them}"]


def _newer_outputs(config: Any, step: int) -> list[tuple[Path, Path]]:
    """``(folder, path)`` of everything a run continued from ``step`` would write again: the
    newer step folders, the files of save_model and its kin (``<exp_name>*``, adapters and
    peft folders included) but those of earlier steps, the samples of later steps, the
    profile and the folders written at the end of a run."""
    checkpoints = Path(config.get_checkpoint_dir()).absolute()
    results = Path(config.get_results_dir()).absolute()
    exp_name = config.exp_name
    found = [(checkpoints, path) for path in newer_checkpoints(checkpoints, step)]
    for path in sorted(checkpoints.glob(f"{glob.escape(exp_name)}*")):
        saved = step_in_name(path.name, exp_name)
        if saved is None or saved > step:
            found.append((checkpoints, path))
    samples = results / SAMPLES_DIR
    if samples.is_dir():
        found += [(results, p) for p in sorted(samples.iterdir()) if (step_of(p) or 0) > step]
    for name in (PROFILE_DIR, *END_OF_RUN_DIRS):
        if (results / name).exists():
            found.append((results, results / name))
    # A path inside another found one moves with it.
    paths = {path for _, path in found}
    unique = dict.fromkeys(found)  # an exp_name such as "lora" finds a folder twice
    return [(f, p) for f, p in unique if not any(parent in paths for parent in p.parents)]


def _holds_a_run(config: Any, folders: list[Path], found: list[str]) -> RunFolderError:
    lines = [f"{folders[0]} already holds another run:", *(f"  {item}" for item in found)]
    checkpoints = Path(config.get_checkpoint_dir()).absolute()
    if any("run checkpoint" in item for item in found):
        lines.append(f"Continue it:      litegen resume --from {checkpoints}")
    lines += [
        "Start a new run:  give it another folder (results_dir=<new folder>)",
        f"Start over here:  add --overwrite; the earlier run moves to {folders[0].name}.old-<time> "
        "beside it, nothing is deleted",
    ]
    return RunFolderError("Run folder holds another run", lines)
