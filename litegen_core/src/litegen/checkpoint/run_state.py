"""Run checkpoints: one folder per saved step, holding everything a run needs to continue exactly.

Layout of ``<checkpoint_dir>``::

    step_<N>/
        model_<i>/            DCP folder of trainable model i: weights, optimizer, EMA (reshards)
        trainer/rank_<r>.pt   step, sampler cursor, LR schedulers, RNG states of rank r
        config.yaml           the resolved config of the run
        launch.yaml           how `litegen launch` started it (entry, ranks), when known
        COMPLETE              written last: a folder without it is never loaded
    latest                    name of the newest complete step folder, updated after the rename
    .step_<N>.tmp-<id>/       a save in progress, or one killed midway: never read, removed later

A save writes into the temporary folder, marks it complete, renames it into place, then moves
the ``latest`` pointer and only then prunes old folders (``keep_last``). A crash or ``kill -9``
at any point therefore leaves the previous complete checkpoint untouched and loadable.
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
import uuid
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from litegen.checkpoint.files import (
    atomic_write,
    atomic_write_text,
    check_model_state,
    replace_dir,
)

COMPLETE = "COMPLETE"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^\.step_\d+\.(tmp|old)-")


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` optimizer steps: ``step_dir_name(10)``
    -> ``'step_10'``."""
    return f"step_{step}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest step first.

    Example:
        >>> list_checkpoints("results/dit")  # doctest: +SKIP
        [(500, PosixPath('results/dit/step_500')), (1000, PosixPath('results/dit/step_1000'))]
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


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

    Example:
        >>> resolve_checkpoint("results/dit")  # doctest: +SKIP
        PosixPath('results/dit/step_1000')
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"run checkpoint {path} does not exist; pass a step_<N> folder written by the "
            f"training loop, or the checkpoint_dir that holds them (cwd: {Path.cwd()})."
        )
    if not path.is_dir():
        raise ValueError(f"run checkpoint {path} is a file; pass a step_<N> folder instead.")
    if not (path / COMPLETE).is_file() and not (path / "trainer").is_dir():
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
    for required in ("config.yaml", "trainer/rank_0.pt", "model_0/.metadata"):
        if not (path / required).is_file():
            raise ValueError(f"run checkpoint {path} is corrupt: {required} is missing.")
    for model_dir in sorted(path.glob("model_*")):
        read_metadata(model_dir)  # raises on a truncated or foreign file
    return path


def read_metadata(model_dir: Path) -> Any:
    """DCP's ``.metadata`` of one model folder; ValueError naming the file when unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(model_dir)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, AttributeError) as err:
        raise ValueError(
            f"run checkpoint {model_dir.parent} is corrupt: {model_dir / '.metadata'} cannot be "
            f"read ({type(err).__name__}: {err})."
        ) from err


def read_config_text(
    path: Path, name: str = "config.yaml", *, optional: bool = False
) -> dict[str, Any]:
    """A YAML mapping a checkpoint folder holds (by default the config it was saved with).

    ``optional``: a missing or empty file reads as ``{}`` instead of raising.

    Example:
        >>> launch = read_config_text(step_dir, "launch.yaml", optional=True)
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


# -- RNG ---------------------------------------------------------------------------------------
def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """Every global RNG state that training draws from on this rank.

    Example:
        >>> state = capture_rng(); torch.rand(1); restore_rng(state)
    """
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's key is an array; a list keeps the file loadable with weights_only=True.
        "numpy": {**np_state, "state": {k: _plain(v) for k, v in np_state["state"].items()}},
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Put back what :func:`capture_rng` returned."""
    random.setstate(_as_tuple(state["python"]))
    np_state = dict(state["numpy"])
    np_state["state"] = {
        k: np.asarray(v, dtype=np.uint32) if k == "key" else v for k, v in np_state["state"].items()
    }
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value


# -- what is saved ------------------------------------------------------------------------------
@dataclass
class Trainable:
    """One trainable model as checkpoints see it: its strategy's sharded state, the optimizer's,
    and the EMA's when it goes with this model.

    ``strategy`` is the model's :class:`litegen.parallel.base.Strategy` (its ``dcp_state`` and
    ``load_dcp_state``); ``ema`` an EMA with ``dcp_state``/``load_dcp_state``, or None.

    Example:
        >>> Trainable(model, optimizer, strategy, ema=None).dcp_state().keys()
        dict_keys(['model', 'optimizer'])
    """

    module: Any
    optimizer: Any
    strategy: Any
    ema: Any = None

    def dcp_state(self) -> dict[str, Any]:
        """The state ``torch.distributed.checkpoint`` saves, and loads in place."""
        state = self.strategy.dcp_state(self.module, self.optimizer)
        if self.ema is not None:
            state["ema"] = self.ema.dcp_state()
        return state

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        """Apply a state :meth:`dcp_state` returned and ``dcp.load`` filled."""
        self.strategy.load_dcp_state(self.module, self.optimizer, state)
        if self.ema is not None:
            self.ema.load_dcp_state(state["ema"])

    def model_shapes(self) -> dict[str, Any]:
        """The model's tensors at their global shapes (to check a checkpoint against)."""
        return self.strategy.dcp_state(self.module)["model"]


# -- save --------------------------------------------------------------------------------------
class RunCheckpointer:
    """Writes and reads the run checkpoints of one prepared job. Call every method on every rank.

    ``trainables`` returns what to save (``LiteGen.trainables``); it is called at each save and
    load, so models prepared later are included.

    Example:
        >>> ckpt = RunCheckpointer(gen.trainables, "results/dit", keep_last=3)
        >>> ckpt.save(1000, {"step": 1000, ...}, extra_files={"config.yaml": config.to_yaml()})
        >>> ckpt.wait()  # only needed with async_save=True
    """

    def __init__(
        self,
        trainables: Callable[[], list[Trainable]],
        root: str | Path,
        *,
        keep_last: int | None = None,
        async_save: bool = False,
    ) -> None:
        self.trainables = trainables
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: tuple[list[Any], Path, int] | None = None
        self._group = None
        if async_save:
            # The background writer runs collectives while the loop runs its own; a separate
            # gloo group keeps the two from interleaving on one communicator.
            self._group = dist.new_group(backend="gloo")

    def save(self, step: int, rank_state: dict[str, Any], extra_files: Mapping[str, str]) -> None:
        """Start writing ``step_<step>``; it is complete (and ``latest``) once :meth:`wait` ran.

        ``rank_state`` is this rank's trainer state; ``extra_files`` (name -> text) are written
        by rank 0. Synchronous saves call :meth:`wait` before returning.
        """
        self.wait()  # the previous asynchronous save must be complete before the next starts
        rank = dist.get_rank()
        name = [None]
        if rank == 0:
            self._remove_leftovers()
            name[0] = f".step_{step}.tmp-{uuid.uuid4().hex[:8]}"
            (self.root / name[0] / "trainer").mkdir(parents=True)
            for filename, text in extra_files.items():
                atomic_write_text(self.root / name[0] / filename, text)
        dist.broadcast_object_list(name, src=0)  # also: the folder exists before anyone writes
        tmp = self.root / name[0]
        atomic_write(tmp / "trainer" / f"rank_{rank}.pt", lambda p: torch.save(rank_state, p))
        import torch.distributed.checkpoint as dcp

        futures = []
        for i, target in enumerate(self.trainables()):
            # Plain DCP writes: tmp is already the temporary folder wait() renames into place.
            model_dir = str(tmp / f"model_{i}")
            state = target.dcp_state()
            if self.async_save:
                # async_save copies the state to CPU memory before returning, so the loop may
                # change the weights while the copy is written.
                futures.append(
                    dcp.async_save(state, checkpoint_id=model_dir, process_group=self._group)
                )
            else:
                dcp.save(state, checkpoint_id=model_dir)
        self._pending = (futures, tmp, step)
        if not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Finish the pending save: marker, rename into place, ``latest``, then retention."""
        if self._pending is None:
            return
        futures, tmp, step = self._pending
        self._pending = None
        for future in futures:
            future.result()
        dist.barrier()  # every rank's files are written before rank 0 declares them complete
        if dist.get_rank() == 0:
            final = self.root / step_dir_name(step)
            _publish(tmp, final)
            atomic_write_text(self.root / LATEST, final.name + "\n")
            self._prune(keep=final)
        dist.barrier()

    def _remove_leftovers(self) -> None:
        """Temporary folders of saves that were killed midway (they were never complete)."""
        if self.root.is_dir():
            for child in self.root.iterdir():
                if _LEFTOVER.match(child.name):
                    shutil.rmtree(child, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        if not self.keep_last:
            return
        old = [path for _, path in list_checkpoints(self.root) if path != keep]
        for path in old[: max(0, len(old) - (self.keep_last - 1))]:
            # Marker first: a folder half-deleted by a crash then reads as partial, not valid.
            (path / COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------
    def load(self, path: str | Path) -> dict[str, Any]:
        """Validate ``path``, load weights/optimizer/EMA in place, return this rank's state.

        Shapes are checked against DCP's metadata before anything is loaded, so a mismatching
        model raises a ValueError naming the checkpoint and every differing tensor.
        """
        path = resolve_checkpoint(path)
        targets = self.trainables()
        saved = len(list(path.glob("model_*")))
        if saved != len(targets):
            raise ValueError(
                f"run checkpoint {path} holds {saved} trainable model(s), this run prepares "
                f"{len(targets)}; resume with the entry module that wrote it."
            )
        for i, target in enumerate(targets):
            self._check(path / f"model_{i}", target)
        import torch.distributed.checkpoint as dcp

        for i, target in enumerate(targets):
            try:
                state = target.dcp_state()
                dcp.load(state, checkpoint_id=str(path / f"model_{i}"))
                target.load_dcp_state(state)
            except Exception as err:  # DCP wraps every rank's read error in one exception
                raise ValueError(
                    f"run checkpoint {path} is corrupt: loading model_{i} failed "
                    f"({type(err).__name__}: {str(err)[:500]})."
                ) from err
        saved_ranks = len(list((path / "trainer").glob("rank_*.pt")))
        # At another world size rank r takes rank r % saved's state (see docs/resume.md).
        rank_file = path / "trainer" / f"rank_{dist.get_rank() % max(saved_ranks, 1)}.pt"
        try:
            return torch.load(rank_file, map_location="cpu", weights_only=True)
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
            raise ValueError(
                f"run checkpoint {path} is corrupt: {rank_file} cannot be read "
                f"({type(err).__name__}: {err})."
            ) from err

    def _check(self, model_dir: Path, target: Trainable) -> None:
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


def _publish(tmp: Path, final: Path) -> None:
    """Mark ``tmp`` complete and rename it to ``final`` (replacing an older one of that name)."""
    atomic_write_text(tmp / COMPLETE, "ok\n")
    replace_dir(tmp, final)
