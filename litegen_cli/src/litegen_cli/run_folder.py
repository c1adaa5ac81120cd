"""One run per folder: ``launch`` refuses a folder that holds another run, ``--overwrite`` moves
that run aside (never deletes it), and a lock keeps two live runs out of one folder.

A run's folders are its ``results_dir`` and, when it lies elsewhere, its ``checkpoint_dir``.
Another run is there when they hold run checkpoints (``step_<N>``, ``latest``), a
``metrics.jsonl`` with records, or final weights (``<exp_name>*.pth``).

The lock is ``.litegen.lock`` in each folder, taken by node 0's ``litegen launch`` or
``litegen resume`` once the recipe is valid, and held until that process ends. It records pid,
host, start time and command; the holder keeps an ``flock`` on it and touches it every
``HEARTBEAT_S`` seconds. A lock is stale, and taken over, when

- its host is this one and its ``flock`` is free (the kernel frees it when the holder dies,
  SIGKILL included), or, where the file system has no flock, its pid is dead;
- its host is another one and it was last touched more than ``STALE_AFTER_S`` seconds ago (the
  pid of another host cannot be checked; an flock held there, where the file system shares
  flocks between hosts, counts as live).

On a multi-node job only node 0 checks, locks and moves the folders: the others share them
(their ranks write checkpoints there, so the file system must be shared) and write nothing
there before the ranks start. Torch-free.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
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

try:
    import fcntl
except ImportError:  # not POSIX: the pid and the heartbeat decide alone
    fcntl = None

LOCK_NAME = ".litegen.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0


class RunFolderError(Exception):
    """The run folder cannot be used now; ``lines`` say why and what to do (exit code 2)."""

    def __init__(self, title: str, lines: list[str]) -> None:
        self.title = title
        self.lines = lines
        super().__init__("\n".join([title, *lines]))


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
            raise _in_use(folder, holder)
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


def _in_use(folder: Path, holder: LockHolder) -> RunFolderError:
    return RunFolderError(
        "Run folder in use",
        [
            f"{folder} is in use by a running litegen: {holder.describe()}.",
            "Wait for it to end or stop it; if it died on another machine, its lock goes stale "
            f"{STALE_AFTER_S:.0f} s after its last heartbeat (or delete {folder / LOCK_NAME}).",
        ],
    )


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


# -- the lock -----------------------------------------------------------------------------------
@dataclass
class LockHolder:
    """Who holds a run folder's lock, as its lock file says."""

    pid: int
    host: str
    started: float
    command: str

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, since {since} ({self.command})"


class RunLock:
    """This process's exclusive hold on one run folder (created if needed).

    Raises :class:`RunFolderError` when a live process holds it; see the module docs for when
    a lock is stale.

    Example:
        >>> with RunLock(Path("results/dit")) as lock:
        ...     lock.path.exists()  # the run writes into results/dit meanwhile
        True
        >>> lock.path.exists()
        False
    """

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._fd = _acquire(self.path)
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="litegen-lock", daemon=True)
        self._heartbeat.start()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def moved_to(self, folder: Path) -> None:
        """The folder was renamed; the lock file moved with it."""
        self.path = Path(folder) / LOCK_NAME

    def release(self) -> None:
        """Remove the lock file (when it is still ours) and drop the lock."""
        if self._fd is None:
            return
        self._stop.set()
        if _same_file(self._fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self._fd) if os.utime in os.supports_fd else os.utime(self.path)
            except (OSError, TypeError):  # released meanwhile
                return


def live_holder(folder: Path) -> LockHolder | None:
    """The live holder of ``folder``'s lock, or None (no lock, or a stale one); writes nothing."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        flocked = _try_flock(fd, shared=True)  # closing the file drops it again
        holder = _read_holder(fd)
        if flocked is False:
            return holder or _unknown()
        if holder is None or _stale(holder, path, flocked):
            return None
        return holder
    finally:
        os.close(fd)


def _acquire(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flocked = _try_flock(fd)
            if flocked is False:
                raise _in_use(path.parent, _read_holder(fd) or _unknown())
            if not _same_file(fd, path):
                os.close(fd)  # its holder removed it while we opened it: take the new one
                continue
            holder = _read_holder(fd)
            if holder is not None and not _stale(holder, path, flocked):
                raise _in_use(path.parent, holder)
            _write_holder(fd)
            return fd
        except BaseException:
            os.close(fd)
            raise


def _unknown() -> LockHolder:
    return LockHolder(0, "unknown host", time.time(), "unknown command")


def _try_flock(fd: int, *, shared: bool = False) -> bool | None:
    """True: locked; False: another process holds it; None: no flock here."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # e.g. ENOLCK or EOPNOTSUPP on some network file systems
        return None
    return True


def _stale(holder: LockHolder, path: Path, flocked: bool | None) -> bool:
    if holder.host == socket.gethostname():
        return flocked is True or not _pid_alive(holder.pid)
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return True
    return age > STALE_AFTER_S


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _read_holder(fd: int) -> LockHolder | None:
    try:
        data = json.loads(os.pread(fd, 65536, 0).decode("utf-8"))
        return LockHolder(
            int(data["pid"]), str(data["host"]), float(data["started"]), str(data["command"])
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError):
        return None  # empty (a holder killed while writing it) or foreign: not a live lock


def _write_holder(fd: int) -> None:
    me = LockHolder(os.getpid(), socket.gethostname(), time.time(), " ".join(sys.argv)[:300])
    data = json.dumps(asdict(me)).encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
