"""Writing run checkpoints: one folder per saved step, holding everything a run needs to continue
exactly (the layout: :mod:`litegen.checkpoint.layout`; loading: :mod:`litegen.checkpoint.run_load`).

A save writes into the temporary folder; once every rank's files are written, rank 0 hashes
them into the manifest, marks the folder complete, renames it into place, moves the ``latest``
pointer and only then prunes old folders (``keep_last``), all in a background thread that the
next save (or the end of the run) waits for. A crash or ``kill -9`` at any point therefore
leaves the previous complete checkpoint untouched and loadable. Loading checks every file
against the manifest first (sizes, then digests, each rank hashing a share of the files).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from litegen.checkpoint.atomic import atomic_write, atomic_write_text, replace_dir
from litegen.checkpoint.layout import (
    COMPLETE,
    LATEST,
    LEFTOVER,
    TRAINER_DIR,
    model_dir_name,
    rank_file,
    step_dir_name,
    temporary_step_dir_name,
)
from litegen.checkpoint.manifest import write_manifest
from litegen.checkpoint.publisher import Publisher, default_store
from litegen.checkpoint.run_load import load_run_checkpoint
from litegen.checkpoint.save_checks import check_finite, write_failure
from litegen.checkpoint.step_dirs import find_latest, list_checkpoints
from litegen.checkpoint.trainable import Trainable

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


class RunCheckpointer:
    """Writes and reads the run checkpoints of one prepared job. Call every method on every rank.

    A checkpoint holds two kinds of stateful parts. ``trainables`` returns the sharded ones
    (each trainable model with its optimizer and EMA, saved with DCP in ``model_<i>/``); it is
    called at each save and load, so models prepared later are included. ``parts`` are this
    rank's own (trainer state, schedulers, RNG, data position): the entries of every part's
    ``state_dict()`` together make ``trainer/rank_<r>.pt``, and each part's
    ``load_state_dict`` receives that whole dict back.

    Once ``wait`` returns, ``step_1000`` below is complete and ``latest`` (the next save waits
    too).

    Example::

        ckpt = RunCheckpointer(gen.checkpointer.trainables, "results/dit", keep_last=3,
                               parts={"trainer": train_state})
        ckpt.save(1000, {"config.yaml": config.to_yaml()})
        ckpt.wait()
    """

    def __init__(
        self,
        trainables: Callable[[], list[Trainable]],
        root: str | Path,
        *,
        parts: Mapping[str, Stateful] | None = None,
        keep_last: int | None = None,
        async_save: bool = False,
    ) -> None:
        self.trainables = trainables
        self.parts = dict(parts or {})
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

    def save(self, step: int, extra_files: Mapping[str, str]) -> None:
        """Start writing ``step_<step>``; it is complete (and ``latest``) once :meth:`wait` ran.

        The parts' states are taken now; ``extra_files`` (name -> text) are written by rank 0. A synchronous save returns once every rank's files are written; the manifest,
        the marker and ``latest`` follow in rank 0's background thread. A state that is not
        finite raises FloatingPointError before anything is written; a failed write (a full
        disk) an OSError that names the folder, its free space and :meth:`last_good`.
        """
        self.wait()  # the previous asynchronous save must be complete before the next starts
        rank_state = {
            key: value for part in self.parts.values() for key, value in part.state_dict().items()
        }
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
            name[0] = temporary_step_dir_name(step)
            (self.root / name[0] / TRAINER_DIR).mkdir(parents=True)
            for filename, text in extra_files.items():
                atomic_write_text(self.root / name[0] / filename, text)
        dist.broadcast_object_list(name, src=0)  # also: the folder exists before anyone writes
        tmp = self.root / name[0]
        atomic_write(tmp / rank_file(rank), lambda p: torch.save(rank_state, p))
        import torch.distributed.checkpoint as dcp

        futures = []
        for i, state in enumerate(states):
            # Plain DCP writes: tmp is already the temporary folder wait() renames into place.
            model_dir = str(tmp / model_dir_name(i))
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

    def load(self, path: str | Path) -> dict[str, Any]:
        """Validate ``path``, load weights/optimizer/EMA in place
        (:func:`litegen.checkpoint.run_load.load_run_checkpoint`), then every part from this
        rank's state, which is returned.

        A part's ValueError (a checkpoint that does not fit this run) comes back after
        ``path``: "run checkpoint PATH <the part's message>".

        Example::

            state = ckpt.load("results/dit/step_1000")
        """
        state = load_run_checkpoint(path, self.trainables)
        for part in self.parts.values():
            try:
                part.load_state_dict(state)
            except ValueError as err:
                raise ValueError(f"run checkpoint {path} {err}") from None
        return state


def _publish(tmp: Path, final: Path) -> None:
    """Hash ``tmp`` into its manifest, mark it complete and rename it to ``final`` (replacing an
    older one of that name)."""
    write_manifest(tmp)
    atomic_write_text(tmp / COMPLETE, "ok\n")
    replace_dir(tmp, final)
