"""The manifest of a run checkpoint: the size and BLAKE2b digest of every file in its folder.

``MANIFEST.json`` is written after every rank's files and before the ``COMPLETE`` marker, so a
complete checkpoint always has one. Sizes are cheap to check (``litegen resume`` does so before
any rank starts); digests need every byte read once, which the ranks share when they load.
Checkpoints written before manifests existed have none: they load with a warning.

:func:`read_manifest` is the one reader of LiteGen's JSON manifests: this one, and the one of
ZeRO's sharded optimizer files (:class:`litegen.checkpoint.zero_state.ZeroShards`).

Example:
    >>> Path("step_5").mkdir()
    >>> _ = Path("step_5/config.yaml").write_text("seed: 0\\n")
    >>> write_manifest(Path("step_5"))
    PosixPath('step_5/MANIFEST.json')
    >>> size_problems(Path("step_5"), manifest_files(Path("step_5")))
    []
    >>> _ = Path("step_5/config.yaml").write_text("seed: 10\\n")
    >>> size_problems(Path("step_5"), manifest_files(Path("step_5")))
    ['step_5/config.yaml has 9 bytes, the manifest says 8']
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from litegen.checkpoint.atomic import atomic_write_text
from litegen.checkpoint.layout import COMPLETE, MANIFEST

FORMAT = "litegen.run_checkpoint.manifest"
ALGORITHM = "blake2b-256"
# Files that are not part of the manifest: itself, and the marker written after it.
_NOT_LISTED = {MANIFEST, COMPLETE}


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
    return atomic_write_text(folder / MANIFEST, text + "\n")


def is_json(path: Path) -> bool:
    """True when ``path`` is a file that starts like JSON: a manifest, not a state file (those
    are zip, pickle or safetensors files, never JSON)."""
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(1) == b"{"


def read_manifest(path: Path, tags: Mapping[str, str]) -> dict[str, Any] | None:
    """The JSON manifest at ``path`` whose ``tags`` (``"format"`` and the like) have the given
    values; None when there is no file.

    Raises ValueError saying what is wrong (``Type: detail``) when the file is not such a
    manifest; callers add which checkpoint it belongs to.

    Example::

        read_manifest(Path("ckpt/step_500/MANIFEST.json"), {"format": FORMAT})
    """
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or any(data.get(k) != v for k, v in tags.items()):
            found = data if isinstance(data, dict) else {}
            raise ValueError(", ".join(f"{key} {found.get(key)!r}" for key in tags))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from None
    return data


def manifest_files(folder: Path) -> dict[str, dict[str, Any]] | None:
    """``{relative path: {"size", "digest"}}`` of a checkpoint folder; None when it has no
    manifest. Raises ValueError naming the file when the manifest itself is damaged."""
    path = folder / MANIFEST
    try:
        data = read_manifest(path, {"format": FORMAT, "algorithm": ALGORITHM})
        if data is None:
            return None
        try:
            files = data["files"]
            for entry in files.values():
                int(entry["size"]), str(entry["digest"])
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{type(err).__name__}: {err}") from None
    except ValueError as err:
        raise ValueError(
            f"run checkpoint {folder} is corrupt: {path} cannot be read ({err})."
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
