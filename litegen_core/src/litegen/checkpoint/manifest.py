"""The manifest of a run checkpoint: the size and BLAKE2b digest of every file in its folder.

``MANIFEST.json`` is written after every rank's files and before the ``COMPLETE`` marker, so a
complete checkpoint always has one. Sizes are cheap to check (``litegen resume`` does so before
any rank starts); digests need every byte read once, which the ranks share when they load.
Checkpoints written before manifests existed have none: they load with a warning.

Example:
    >>> from pathlib import Path
    >>> Path("step_5").mkdir()
    >>> _ = Path("step_5/config.yaml").write_text("seed: 0\\n")
    >>> write_manifest(Path("step_5"))
    PosixPath('step_5/MANIFEST.json')
    >>> size_problems(Path("step_5"), read_manifest(Path("step_5")))
    []
    >>> _ = Path("step_5/config.yaml").write_text("seed: 10\\n")
    >>> size_problems(Path("step_5"), read_manifest(Path("step_5")))
    ['step_5/config.yaml has 9 bytes, the manifest says 8']
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "MANIFEST.json"
FORMAT = "litegen.run_checkpoint.manifest"
ALGORITHM = "blake2b-256"
# Files that are not part of the manifest: itself, and the marker written after it.
_NOT_LISTED = {MANIFEST, "COMPLETE"}


def file_digest(path: Path) -> str:
    """BLAKE2b (32 bytes) of a file's contents, as hex; reads it in chunks.

    >>> _ = Path("config.yaml").write_text("seed: 0\\n")
    >>> len(file_digest(Path("config.yaml")))  # 32 bytes as hex
    64
    """
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=32)).hexdigest()


def _listed_files(folder: Path) -> list[str]:
    names = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            relative = (Path(root) / name).relative_to(folder).as_posix()
            if relative not in _NOT_LISTED:
                names.append(relative)
    return names


def write_manifest(folder: Path) -> Path:
    """Hash every file under ``folder`` and write ``folder/MANIFEST.json`` (atomically)."""
    files = {}
    for name in _listed_files(folder):
        path = folder / name
        files[name] = {"size": path.stat().st_size, "digest": file_digest(path)}
    text = json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": files}, indent=1)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{MANIFEST}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, folder / MANIFEST)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return folder / MANIFEST


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """``{relative path: {"size", "digest"}}`` of a checkpoint folder; None when it has no
    manifest. Raises ValueError naming the file when the manifest itself is damaged."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if data.get("format") != FORMAT or data.get("algorithm") != ALGORITHM:
            raise ValueError(f"format {data.get('format')!r}, algorithm {data.get('algorithm')!r}")
        for entry in files.values():
            int(entry["size"]), str(entry["digest"])
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"run checkpoint {folder} is corrupt: {path} cannot be read ({type(err).__name__}: "
            f"{err})."
        ) from None
    return files


def size_problems(folder: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """One line per listed file that is missing or whose size differs (reads no contents)."""
    problems = []
    for name, entry in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        if size != entry["size"]:
            problems.append(f"{path} has {size} bytes, the manifest says {entry['size']}")
    return problems


def digest_problems(
    folder: Path, files: dict[str, dict[str, Any]], names: Iterable[str]
) -> list[str]:
    """One line per file among ``names`` whose contents differ from the manifest."""
    problems = []
    for name in names:
        path = folder / name
        try:
            digest = file_digest(path)
        except OSError as err:
            problems.append(f"{path} cannot be read ({type(err).__name__}: {err})")
            continue
        if digest != files[name]["digest"]:
            problems.append(f"{path} does not match its digest in {MANIFEST} (the file changed)")
    return problems


def summarize(problems: list[str]) -> str:
    """The first problem, and how many more there are.

    >>> summarize(["a is missing", "b is missing", "c is missing"])
    'a is missing (and 2 more files)'
    """
    more = len(problems) - 1
    return problems[0] + (f" (and {more} more file{'s' * (more > 1)})" if more else "")


def share_of(files: dict[str, dict[str, Any]], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` verifies: the biggest first, each to the least loaded rank, so
    every rank reads about the same number of bytes (the same split on every rank).

    >>> share_of({"a": {"size": 5}, "b": {"size": 3}, "c": {"size": 2}}, 1, 2)
    ['b', 'c']
    """
    loads = [0] * world_size
    mine = []
    for name, entry in sorted(files.items(), key=lambda item: (-item[1]["size"], item[0])):
        owner = loads.index(min(loads))
        loads[owner] += entry["size"]
        if owner == rank:
            mine.append(name)
    return mine
