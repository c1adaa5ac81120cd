"""The lock that keeps two live runs out of one run folder: ``.litegen.lock`` in the folder, taken
by node 0's ``litegen launch`` or ``litegen resume`` once the recipe is valid and held until that
process ends (:mod:`litegen_cli.run_folder` says when a folder may be used at all).

The lock file records pid, host, start time and command; the holder keeps an ``flock`` on it and
touches it every ``HEARTBEAT_S`` seconds. A lock is stale, and taken over, when

- its host is this one and its ``flock`` is free (the kernel frees it when the holder dies,
  SIGKILL included), or, where the file system has no flock, its pid is dead;
- its host is another one and it was last touched more than ``STALE_AFTER_S`` seconds ago (the
  pid of another host cannot be checked; an flock held there, where the file system shares
  flocks between hosts, counts as live).

Torch-free.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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


def in_use(folder: Path, holder: LockHolder) -> RunFolderError:
    """The error for a folder whose lock a live process holds."""
    return RunFolderError(
        "Run folder in use",
        [
            f"{folder} is in use by a running litegen: {holder.describe()}.",
            "Wait for it to end or stop it; if it died on another machine, its lock goes stale "
            f"{STALE_AFTER_S:.0f} s after its last heartbeat (or delete {folder / LOCK_NAME}).",
        ],
    )


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
                raise in_use(path.parent, _read_holder(fd) or _unknown())
            if not _same_file(fd, path):
                os.close(fd)  # its holder removed it while we opened it: take the new one
                continue
            holder = _read_holder(fd)
            if holder is not None and not _stale(holder, path, flocked):
                raise in_use(path.parent, holder)
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
