"""Run checkpoints: one folder per saved step, holding everything a run needs to continue exactly.

Layout of ``<checkpoint_dir>``::

    step_<N>/
        model_<i>/            DCP folder of trainable model i: weights, optimizer, EMA (reshards)
        trainer/rank_<r>.pt   step, sampler cursor, LR schedulers, RNG states of rank r
        config.yaml           the resolved config of the run
        launch.yaml           how `litegen launch` started it (entry, ranks), when known
        MANIFEST.json         size and BLAKE2b digest of every file above (checkpoint/manifest.py)
        COMPLETE              written last: a folder without it is never loaded
    latest                    name of the newest complete step folder, updated after the rename
    .step_<N>.tmp-<id>/       a save in progress, or one killed midway: never read, removed later

A save writes into the temporary folder; once every rank's files are written, rank 0 hashes
them into the manifest, marks the folder complete, renames it into place, moves the ``latest``
pointer and only then prunes old folders (``keep_last``), all in a background thread that the
next save (or the end of the run) waits for. A crash or ``kill -9`` at any point therefore
leaves the previous complete checkpoint untouched and loadable. Loading checks every file
against the manifest first (sizes, then digests, each rank hashing a share of the files).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import shutil
import uuid
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from litegen.checkpoint.files import (
    atomic_write,
    atomic_write_text,
    check_model_state,
    replace_dir,
)
from litegen.checkpoint.manifest import (
    digest_problems,
    read_manifest,
    share_of,
    summarize,
    write_manifest,
)
from litegen.checkpoint.publisher import Publisher, default_store
from litegen.checkpoint.rng import capture_rng, restore_rng
from litegen.checkpoint.save_checks import check_finite, write_failure
from litegen.checkpoint.step_dirs import (
    COMPLETE,
    LATEST,
    LEFTOVER,
    find_latest,
    list_checkpoints,
    read_config_text,
    read_metadata,
    resolve_checkpoint,
    step_dir_name,
)

# Finding and checking step folders lives in step_dirs, RNG states in rng; their names stay
# importable from here.
__all__ = [
    "COMPLETE",
    "LATEST",
    "RunCheckpointer",
    "Trainable",
    "capture_rng",
    "find_latest",
    "list_checkpoints",
    "read_config_text",
    "read_metadata",
    "resolve_checkpoint",
    "restore_rng",
    "step_dir_name",
]

log = logging.getLogger("litegen")


# -- what is saved ------------------------------------------------------------------------------
@dataclass
class Trainable:
    """One trainable model as checkpoints see it: its strategy's sharded state, the optimizer's,
    and the EMA's when it goes with this model.

    ``strategy`` is the model's :class:`litegen.parallel.base.Strategy` (its ``dcp_state`` and
    ``load_dcp_state``); ``ema`` an EMA with ``dcp_state``/``load_dcp_state``, or None.

    Example::

        Trainable(model, optimizer, strategy, ema=None).dcp_state().keys()
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

    def load(self, checkpoint_id: str | Path) -> None:
        """Load the DCP folder ``checkpoint_id`` into the model (optimizer, EMA) in place.

        Example::

            Trainable(model, optimizer, strategy).load("ckpt/step_100/model_0")
        """
        import torch.distributed.checkpoint as dcp

        state = self.dcp_state()
        # FSDP1 chunks each parameter on dim 0, so a rank past that dim's size (Wan's
        # (1, 6, dim) scale_shift_table on rank 1) holds a ShardedTensor with no local shard.
        # DCP's default planner drops those while flattening nested ShardedTensors, then reads
        # the checkpoint keys it no longer sees as a pre-2.4 layout and asks for keys never
        # written. LiteGen never nests ShardedTensors (that is FSDP1 with tensor parallelism),
        # so the flattening is off.
        planner = dcp.DefaultLoadPlanner(flatten_sharded_tensors=False)
        dcp.load(state, checkpoint_id=str(checkpoint_id), planner=planner)
        self.load_dcp_state(state)

    def model_shapes(self) -> dict[str, Any]:
        """The model's tensors at their global shapes (to check a checkpoint against)."""
        return self.strategy.dcp_state(self.module)["model"]


# -- save --------------------------------------------------------------------------------------
class RunCheckpointer:
    """Writes and reads the run checkpoints of one prepared job. Call every method on every rank.

    ``trainables`` returns what to save (``LiteGen.trainables``); it is called at each save and
    load, so models prepared later are included.

    Example::

        ckpt = RunCheckpointer(gen.trainables, "results/dit", keep_last=3)
        ckpt.save(1000, {"step": 1000, ...}, extra_files={"config.yaml": config.to_yaml()})
        ckpt.wait()  # step_1000 is complete and `latest` (the next save waits too)
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
        self._sealed = False  # files written everywhere; rank 0 may still be publishing them
        self._publisher: Publisher | None = None  # rank 0's background publication
        self._last_sealed: int | None = None  # the last step every rank wrote, in this process
        self._published_key = ""  # set in the store once rank 0 has published the last save
        self._group = None
        if async_save:
            # The background writer runs collectives while the loop runs its own; a separate
            # gloo group keeps the two from interleaving on one communicator.
            self._group = dist.new_group(backend="gloo")

    def save(self, step: int, rank_state: dict[str, Any], extra_files: Mapping[str, str]) -> None:
        """Start writing ``step_<step>``; it is complete (and ``latest``) once :meth:`wait` ran.

        ``rank_state`` is this rank's trainer state; ``extra_files`` (name -> text) are written
        by rank 0. A synchronous save returns once every rank's files are written; the manifest,
        the marker and ``latest`` follow in rank 0's background thread. A state that is not
        finite raises FloatingPointError before anything is written; a failed write (a full
        disk) an OSError that names the folder, its free space and :meth:`last_good`.
        """
        self.wait()  # the previous asynchronous save must be complete before the next starts
        targets = self.trainables()
        states = [target.dcp_state() for target in targets]
        check_finite(states, step, self.last_good())  # before a byte is written
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self._write(step, rank_state, extra_files, states)
        # DCP gathers every rank's write error into a CheckpointException, a BaseException.
        except (Exception, CheckpointException) as err:
            raise write_failure(err, self.root, step, self.last_good()) from err
        if not self.async_save:
            self._seal()

    def _write(
        self,
        step: int,
        rank_state: dict[str, Any],
        extra_files: Mapping[str, str],
        states: list[dict[str, Any]],
    ) -> None:
        """Write every file of ``step_<step>`` into a temporary folder (see :meth:`save`)."""
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
        for i, state in enumerate(states):
            # Plain DCP writes: tmp is already the temporary folder wait() renames into place.
            model_dir = str(tmp / f"model_{i}")
            if self.async_save:
                # async_save copies the state to CPU memory before returning, so the loop may
                # change the weights while the copy is written.
                futures.append(
                    dcp.async_save(state, checkpoint_id=model_dir, process_group=self._group)
                )
            else:
                dcp.save(state, checkpoint_id=model_dir)
        self._pending = (futures, tmp, step)

    def _seal(self) -> None:
        """Once every rank's files are written, rank 0 publishes them in a background thread:
        manifest (hashing every file), marker, rename into place, ``latest``, retention."""
        futures, tmp, step = self._pending
        self._pending = None
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            for future in futures:
                future.result()
        except (Exception, CheckpointException) as err:
            raise write_failure(err, self.root, step, self.last_good()) from err
        dist.barrier()  # every rank's files are written before rank 0 hashes and publishes them
        self._sealed = True
        self._last_sealed = step
        self._published_key = f"litegen/published/{tmp.name}"
        if dist.get_rank() == 0:
            self._publisher = Publisher(self._publish_step, tmp, step)

    def _publish_step(self, tmp: Path, step: int) -> None:
        try:
            final = self.root / step_dir_name(step)
            _publish(tmp, final)
            atomic_write_text(self.root / LATEST, final.name + "\n")
            self._prune(keep=final)
        finally:  # published or failed: ranks waiting in finish_after_failure may go
            store = default_store()
            if store is not None:
                store.set(self._published_key, "done")

    def finish_after_failure(self, timeout_s: float = 120.0) -> None:
        """After a failure, before the process exits: let the last save that every rank wrote
        finish publishing, so that the last good checkpoint an error names is complete.

        Rank 0 joins its publishing thread; the other ranks wait (at most ``timeout_s``) for
        it through the process group's store, not a collective, which ranks that failed at
        different points could mismatch (and torchrun stops rank 0 once another rank exits).
        """
        if not self._sealed:
            return
        if dist.get_rank() == 0:
            publisher, self._publisher = self._publisher, None
            if publisher is not None:
                publisher.join()
            return
        store = default_store()
        if store is not None:
            from datetime import timedelta

            with contextlib.suppress(Exception):  # a timeout: rank 0 died meanwhile
                store.wait([self._published_key], timedelta(seconds=timeout_s))

    def wait(self) -> None:
        """Finish the last save: once this returns on any rank, it is complete and ``latest``."""
        if self._pending is not None:
            self._seal()
        if not self._sealed:
            return
        self._sealed = False
        publisher, self._publisher = self._publisher, None
        error = publisher.join() if publisher is not None else None
        dist.barrier()  # rank 0 has published (or failed to)
        if error is not None:
            # Not published: the last good one is the one `latest` still names.
            failed, self._last_sealed = self._last_sealed, None
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: as they are
                raise error
            raise write_failure(error, self.root, failed, self.last_good()) from error

    def last_good(self) -> Path | None:
        """The newest checkpoint known good: the last one this process wrote (complete once
        rank 0 has published it), else the complete one ``latest`` names."""
        if self._last_sealed is not None:
            return self.root / step_dir_name(self._last_sealed)
        return find_latest(self.root)

    def _remove_leftovers(self) -> None:
        """Temporary folders of saves that were killed midway (they were never complete)."""
        if self.root.is_dir():
            for child in self.root.iterdir():
                if LEFTOVER.match(child.name):
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
        self._verify_digests(path)
        targets = self.trainables()
        saved = len(list(path.glob("model_*")))
        if saved != len(targets):
            raise ValueError(
                f"run checkpoint {path} holds {saved} trainable model(s), this run prepares "
                f"{len(targets)}; resume with the entry module that wrote it."
            )
        for i, target in enumerate(targets):
            self._check(path / f"model_{i}", target)
        from torch.distributed.checkpoint.api import CheckpointException

        for i, target in enumerate(targets):
            try:
                target.load(path / f"model_{i}")
            # DCP gathers every rank's read error into a CheckpointException, a BaseException.
            except (Exception, CheckpointException) as err:
                raise ValueError(
                    f"run checkpoint {path} is corrupt: loading {path / f'model_{i}'} failed "
                    f"({_one_line(err)})."
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

    def _verify_digests(self, path: Path) -> None:
        """Every rank hashes its share of the files; any mismatch raises on every rank."""
        manifest = read_manifest(path)
        if manifest is None:
            if dist.get_rank() == 0:
                log.warning(
                    "run checkpoint %s has no MANIFEST.json (it was written by an older "
                    "LiteGen), so its files cannot be verified; loading it as it is.",
                    path,
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
    """Hash ``tmp`` into its manifest, mark it complete and rename it to ``final`` (replacing an
    older one of that name)."""
    write_manifest(tmp)
    atomic_write_text(tmp / COMPLETE, "ok\n")
    replace_dir(tmp, final)


def _one_line(err: BaseException) -> str:
    """``Type: first line`` of an error; for DCP's CheckpointException, of the first rank's."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {_one_line(cause)}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"
