"""Files that appear complete or not at all, with the modes the umask asks for.

Every file a run or an export writes goes through :func:`atomic_write`: written under a
temporary name in the target folder, flushed to disk and renamed into place. Folders are built
under a temporary name and renamed by :func:`replace_dir`. Torch-free: the CLI uses it before
any rank starts.

Example:
    >>> atomic_write_text("out/config.yaml", "seed: 0\\n")
    PosixPath('out/config.yaml')
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where the OS tells it (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def temp_file_beside(path: Path) -> Path:
    """A new empty file ``.<name>.*.tmp`` in ``path``'s folder, with the mode an ordinary
    ``open(path, "w")`` would give (``mkstemp`` makes 0600, which would hide a file of a
    group-shared run folder from the group)."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
    finally:
        os.close(fd)
    return Path(tmp_name)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)``, fsync, then rename onto ``path``: the file appears complete or
    not at all. ``tmp_path`` lies in the same folder and keeps ``path``'s suffix last but one
    (``.<name>.<random>.tmp``), so writers that pick a format by suffix see ``.tmp``; those
    pass the format themselves.

    Example:
        >>> atomic_write("out/notes.txt", lambda tmp: tmp.write_text("done"))
        PosixPath('out/notes.txt')
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_file_beside(path)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_write`."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def replace_dir(tmp: str | Path, final: str | Path) -> Path:
    """Rename a finished folder onto ``final``; an older ``final`` steps aside, then goes.

    A crash between the two renames leaves the old folder under ``.<name>.old-*``, never a
    half-written one under ``final``.
    """
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final
