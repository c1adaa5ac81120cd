"""On-disk shard format of :class:`litegen.cache.TensorCache`.

A shard is a pair of files written by one writer and never changed afterwards:

* ``<writer>-<seq>.safetensors``: the tensors of a batch of entries, named ``"<i>.<j>"``.
* ``<writer>-<seq>.json``: the shard's index: its byte length and, per key, which stored
  tensor holds which user tensor and the CRC-32 of that tensor's bytes.

The ``.json`` file is written last, so it marks the shard complete: readers only ever see
shards whose data is already in place. Both files are written atomically (temporary
file, fsync, ``os.replace``), so a crash leaves at most a stray temporary file.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save

FORMAT_VERSION = 1
DATA_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".json"

# Errors that mean "this shard cannot be trusted", as opposed to programming errors.
READ_ERRORS = (OSError, ValueError, RuntimeError, KeyError, safetensors.SafetensorError)


class CorruptShardError(Exception):
    """A shard's bytes do not match its index (truncated, overwritten or flipped)."""


# Errors that mean the shard's bytes are wrong for sure (not a passing I/O failure).
DAMAGE_ERRORS = (CorruptShardError, safetensors.SafetensorError)


@dataclass(frozen=True)
class Entry:
    """Where one key's tensors live: the shard and, per tensor name, its stored name and CRC."""

    shard: str
    names: dict[str, str]
    crc32: dict[str, int]


@dataclass(frozen=True)
class ShardIndex:
    name: str
    nbytes: int
    entries: dict[str, Entry]


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's raw bytes (any dtype, including bfloat16)."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(raw)


def write_shard(directory: Path, name: str, entries: dict[str, dict[str, torch.Tensor]]) -> int:
    """Write ``entries`` (key -> tensors, CPU and contiguous) as shard ``name``; return its bytes."""
    flat: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    for i, (key, tensors) in enumerate(entries.items()):
        names, crcs = {}, {}
        for j, (tensor_name, tensor) in enumerate(tensors.items()):
            stored = f"{i}.{j}"  # user names may contain anything; stored names stay simple
            flat[stored] = tensor
            names[tensor_name] = stored
            crcs[tensor_name] = tensor_crc32(tensor)
        index[key] = {"tensors": names, "crc32": crcs}
    data = save(flat)
    atomic_write(directory / (name + DATA_SUFFIX), data)
    meta = {"format": FORMAT_VERSION, "bytes": len(data), "entries": index}
    atomic_write(directory / (name + INDEX_SUFFIX), json.dumps(meta).encode())
    return len(data)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either nothing or all of it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    # Makes the rename durable; not every platform or file system allows it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_shards(directory: Path) -> list[str]:
    """Names of the completed shards in ``directory``, sorted (so readers agree on order)."""
    names = []
    for entry in os.scandir(directory):
        if entry.name.endswith(INDEX_SUFFIX) and not entry.name.startswith("."):
            names.append(entry.name[: -len(INDEX_SUFFIX)])
    return sorted(names)


def read_index(directory: Path, name: str) -> ShardIndex | None:
    """Load and sanity-check one shard's index; ``None`` (with a warning) if it is damaged."""
    try:
        meta = json.loads((directory / (name + INDEX_SUFFIX)).read_bytes())
        nbytes = int(meta["bytes"])
        entries = {
            key: Entry(name, dict(e["tensors"]), {k: int(v) for k, v in e["crc32"].items()})
            for key, e in meta["entries"].items()
        }
        actual = (directory / (name + DATA_SUFFIX)).stat().st_size
    except (*READ_ERRORS, TypeError, AttributeError) as err:
        warn_corrupt(directory, name, f"unreadable index or data file ({err})")
        return None
    if actual != nbytes:
        warn_corrupt(directory, name, f"data file has {actual} bytes, its index says {nbytes}")
        return None
    return ShardIndex(name, nbytes, entries)


def open_shard(directory: Path, name: str):
    """Memory-map a shard's data file (``safe_open`` reads tensors straight from the map)."""
    return safe_open(str(directory / (name + DATA_SUFFIX)), framework="pt", device="cpu")


def read_entry(handle, entry: Entry) -> dict[str, torch.Tensor]:
    """Read one entry's tensors, checking each against its CRC; raise CorruptShardError."""
    tensors = {}
    for tensor_name, stored in entry.names.items():
        try:
            tensor = handle.get_tensor(stored)
        except READ_ERRORS as err:
            raise CorruptShardError(f"cannot read tensor {stored!r}: {err}") from err
        if tensor_crc32(tensor) != entry.crc32[tensor_name]:
            raise CorruptShardError(f"checksum mismatch in tensor {stored!r}")
        tensors[tensor_name] = tensor
    return tensors


def warn_corrupt(directory: Path, name: str, why: str) -> None:
    warnings.warn(
        f"tensor cache shard {directory / name}{DATA_SUFFIX} is damaged ({why}); its entries "
        "are treated as misses. `litegen cache build` with the run's recipe re-encodes them "
        "and moves the damaged shard aside.",
        RuntimeWarning,
        stacklevel=3,
    )


def move_aside(directory: Path, name: str) -> None:
    """Rename a damaged shard's files to ``.<name>.<suffix>.damaged``: no reader lists them any
    more, and their bytes stay for a look (delete them when done)."""
    for suffix in (INDEX_SUFFIX, DATA_SUFFIX):  # the index first: it marks the shard complete
        path = directory / (name + suffix)
        with contextlib.suppress(FileNotFoundError):  # another rank moved it first
            os.replace(path, directory / f".{path.name}.damaged")
