"""Cache keys of files: what identifies a media file's cached latents and embeddings.

By default a key hashes the file's path (relative to its folder), size and modification time,
plus ``extra`` (its caption): cheap, nothing is read, and any edit through ordinary tools
changes the time. A tool that rewrites bytes and keeps size and time (some sync tools, a
restored backup) goes unnoticed; ``content_digest=True`` hashes the file's bytes in place of
its time, so such a change is a miss, at the price of reading every byte of every file each
time the keys are made (at each launch and ``cache build``).

Example:
    >>> _ = Path("fox.txt").write_text("a fox")
    >>> len(file_key(Path("fox.txt"))), file_key("fox.txt") == file_key("fox.txt", extra="a fox")
    (24, False)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["file_key"]

_CHUNK = 1 << 20


def file_key(
    path: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    extra: str = "",
    content_digest: bool = False,
) -> str:
    """The 24-hex-digit cache key of the file ``path``: its path relative to ``root``, size and
    modification time (or, with ``content_digest``, a BLAKE2b digest of its bytes), and
    ``extra``. Names that are not valid UTF-8 are hashed as their bytes.

    Example::

        keys = [file_key(f.path, root=dataset.root, extra=f.caption) for f in dataset.files]
    """
    path = Path(path)
    stat = path.stat()
    name = os.fsencode(path.relative_to(root) if root is not None else path)
    stamp = _content_digest(path) if content_digest else str(stat.st_mtime_ns)
    identity = b"|".join([name, str(stat.st_size).encode(), stamp.encode(), _text(extra)])
    return hashlib.sha256(identity).hexdigest()[:24]


def _content_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return "blake2b:" + digest.hexdigest()


def _text(value: str) -> bytes:
    return value.encode("utf-8", errors="surrogateescape")
