"""TensorCache: tensors computed once per sample (latents, text embeddings), kept on disk.

Layout: ``root/<fingerprint>/<writer>-<seq>.safetensors`` plus a ``.json`` index per shard
(see :mod:`litegen.cache.shards`). Every writer (rank, node, process) writes only files
named after its own unique writer id and never rewrites a file, so any number of writers
can fill one cache on a shared file system; readers merge the per-shard indexes.
"""

from __future__ import annotations

import numbers
import os
import re
import socket
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from litegen.cache import shards
from litegen.cache.shards import CorruptShardError, Entry

__all__ = ["CacheStats", "TensorCache", "split_batch"]

Tensors = dict[str, torch.Tensor]
# fn in get_or_compute returns one dict per key, or one dict of tensors batched on dim 0.
BatchOutput = Sequence[Mapping[str, torch.Tensor]] | Mapping[str, torch.Tensor]

_FINGERPRINT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class CacheStats:
    """Counters for this process; ``bytes_*`` count tensor bytes."""

    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt_shards: int = 0


class TensorCache:
    """A disk cache of tensor dicts, keyed by sample identity within an encoder fingerprint.

    Args:
        root: cache directory; each fingerprint gets its own subdirectory.
        fingerprint: names the encoder and settings (see :func:`litegen.cache.fingerprint`),
            so a changed encoder starts an empty namespace instead of serving stale tensors.
        dtype: floating tensors are stored in this dtype (``None`` keeps theirs); integer
            and bool tensors are stored as they are.
        max_bytes: budget for the namespace on disk (all writers' shards seen so far plus
            this writer's unflushed tensors); ``put`` past it raises ``ValueError``.
        shard_bytes: buffered bytes that trigger writing a shard.

    Keys are compared as strings (``7`` and ``"7"`` are the same key).

    Example:
        >>> from litegen.cache import fingerprint
        >>> cache = TensorCache("cache", fingerprint(resolution=256))
        >>> out = cache.get_or_compute([0, 1], lambda missing: {"latent": torch.zeros(2, 4)})
        >>> cache.flush()
        >>> out[0]["latent"].shape, cache.get_or_compute([1], lambda missing: {})[0]["latent"].dtype
        (torch.Size([4]), torch.bfloat16)
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: str,
        *,
        dtype: torch.dtype | None = torch.bfloat16,
        max_bytes: int | None = None,
        shard_bytes: int = 256 << 20,
    ) -> None:
        if not isinstance(fingerprint, str) or not _FINGERPRINT.match(fingerprint):
            raise ValueError(
                f"fingerprint must be a plain directory name (letters, digits, '.', '_', '-'), "
                f"got {fingerprint!r}; build one with litegen.cache.fingerprint(encoder, ...)"
            )
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None (no budget), got {max_bytes}")
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.directory = self.root / fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.shard_bytes = shard_bytes
        self.stats = CacheStats()
        # Host, pid and a random part: unique across processes, nodes and restarts.
        self.writer_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._seq = 0
        self._index: dict[str, list[Entry]] = {}  # key -> entries, preferred first
        self._shard_bytes: dict[str, int] = {}  # valid shards -> data file bytes
        self._seen: set[str] = set()  # shards whose index was read (valid or not)
        self.damaged: set[str] = set()  # shards found damaged, by name
        self._moved: set[str] = set()  # ... and moved aside by verify
        self._handles: dict[str, object] = {}
        self._pending: dict[str, Tensors] = {}
        self._pending_bytes = 0
        self.refresh()

    # -- reading ---------------------------------------------------------------------------

    def refresh(self) -> None:
        """Pick up shards that other writers completed since the last refresh."""
        for name in shards.list_shards(self.directory):
            if name in self._seen:
                continue
            self._seen.add(name)
            index = shards.read_index(self.directory, name)
            if index is None:
                self.stats.corrupt_shards += 1
                self.damaged.add(name)
                continue
            self._shard_bytes[name] = index.nbytes
            for key, entry in index.entries.items():
                self._index.setdefault(key, []).append(entry)

    def get(self, key: Hashable) -> Tensors | None:
        """The tensors stored for ``key``, or ``None`` on a miss (damaged entries are misses)."""
        tensors = self._lookup(_key(key))
        if tensors is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return tensors

    def verify(self, keys: Sequence[Hashable]) -> list[str]:
        """Read back the stored entries of ``keys`` and check every tensor against its
        checksum (every byte is read); return the keys whose entries were all damaged.

        A shard whose bytes do not match its index is moved aside (``.<name>.*.damaged``), so
        its entries are misses here and in every later process, until they are stored again.
        ``__contains__`` trusts the index alone; ``verify`` is what ``litegen cache build``
        counts hits with.

        Example:
            >>> cache = TensorCache("cache", "enc-1")
            >>> _ = cache.put(0, {"z": torch.ones(2)}); cache.flush()
            >>> cache.verify([0, 1])  # 1 was never stored: not damaged, just missing
            []
        """
        for name in self.damaged - self._moved:  # unreadable index: no entry of it is served
            shards.move_aside(self.directory, name)
            self._moved.add(name)
        damaged = []
        for name in dict.fromkeys(_key(k) for k in keys):
            if self._index.get(name) and self._lookup(name, move_aside=True) is None:
                damaged.append(name)
        return damaged

    def __contains__(self, key: Hashable) -> bool:
        key = _key(key)
        return key in self._pending or bool(self._index.get(key))

    def keys(self) -> set[str]:
        """Every key stored (on disk as of the last refresh, or buffered here)."""
        return {k for k, entries in self._index.items() if entries} | set(self._pending)

    def __len__(self) -> int:
        return len(self.keys())

    @property
    def total_bytes(self) -> int:
        """Bytes on disk in this namespace (shards seen so far) plus unflushed tensor bytes."""
        return sum(self._shard_bytes.values()) + self._pending_bytes

    # -- writing ---------------------------------------------------------------------------

    def put(self, key: Hashable, tensors: Mapping[str, torch.Tensor]) -> Tensors:
        """Buffer ``tensors`` for ``key`` (written at the next shard or ``flush``).

        Returns the tensors as stored (CPU, cache dtype), i.e. what ``get`` will return.
        """
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(
                f"put({key!r}, ...) needs a non-empty dict of tensors, got {tensors!r}"
            )
        key = _key(key)
        stored = {name: self._convert(t) for name, t in tensors.items()}
        nbytes = sum(t.nbytes for t in stored.values())
        old = self._pending.get(key)
        old_bytes = 0 if old is None else sum(t.nbytes for t in old.values())
        total = self.total_bytes - old_bytes + nbytes
        if self.max_bytes is not None and total > self.max_bytes:
            raise ValueError(
                f"tensor cache {self.directory} would grow to {_size(total)}, over its "
                f"max_bytes budget of {_size(self.max_bytes)} (this entry: {_size(nbytes)}); "
                "raise max_bytes, pass max_bytes=None, or delete unused fingerprint "
                f"directories under {self.root}"
            )
        self._pending[key] = stored
        self._pending_bytes += nbytes - old_bytes
        if self._pending_bytes >= self.shard_bytes:
            self.flush()
        return stored

    def flush(self) -> None:
        """Write buffered entries as one shard (atomic; a no-op when nothing is buffered)."""
        if not self._pending:
            return
        name = f"{self.writer_id}-{self._seq:06d}"
        self._seq += 1
        nbytes = shards.write_shard(self.directory, name, self._pending)
        index = shards.read_index(self.directory, name)
        if index is None:  # read_index already warned
            raise OSError(f"tensor cache shard {self.directory / name} did not survive writing")
        self._seen.add(name)
        self._shard_bytes[name] = nbytes
        for key, entry in index.entries.items():
            self._index.setdefault(key, []).insert(0, entry)  # newest first: rebuilt entries win
        self.stats.bytes_written += self._pending_bytes
        self._pending.clear()
        self._pending_bytes = 0

    def get_or_compute(
        self, keys: Sequence[Hashable], fn: Callable[[list[Hashable]], BatchOutput]
    ) -> list[Tensors]:
        """Tensors for every key in ``keys``, calling ``fn(missing_keys)`` once for the misses.

        ``fn`` returns one dict per missing key, or one dict of tensors batched along dim 0.
        Results come back as stored (cache dtype), so cached and fresh batches match.

        Example:
            >>> from litegen.cache import fingerprint
            >>> cache = TensorCache("cache", fingerprint(version=1))
            >>> encode = lambda ks: {"z": torch.tensor(ks, dtype=torch.float32)[:, None]}
            >>> out = cache.get_or_compute([3, 9], encode)
            >>> torch.stack([o["z"] for o in out]).flatten().tolist()
            [3.0, 9.0]
        """
        names = [_key(k) for k in keys]
        found: dict[str, Tensors] = {}
        for name in names:
            tensors = self._lookup(name)
            if tensors is not None:
                found[name] = tensors
        if len(found) < len(set(names)):
            self.refresh()  # another writer may have stored some of them meanwhile
            for name in set(names) - set(found):
                tensors = self._lookup(name)
                if tensors is not None:
                    found[name] = tensors
        hits = sum(name in found for name in names)
        self.stats.hits += hits
        self.stats.misses += len(names) - hits

        # Each missing key once, in first-seen order, passed to fn as the caller spelled it.
        missing = {name: key for name, key in zip(names, keys, strict=True) if name not in found}
        if missing:
            computed = split_batch(fn(list(missing.values())), len(missing))
            for name, tensors in zip(missing, computed, strict=True):
                found[name] = self.put(name, tensors)
        return [found[name] for name in names]

    def __enter__(self) -> TensorCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()

    # -- internals -------------------------------------------------------------------------

    def _convert(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else None
        # copy=True: later edits to the caller's tensor must not change the cached one.
        return tensor.detach().to("cpu", dtype=dtype, copy=True).contiguous()

    def _lookup(self, key: str, *, move_aside: bool = False) -> Tensors | None:
        """The first intact entry of ``key``; damaged shards met on the way are dropped (and
        with ``move_aside``, when their bytes disagree with their index, moved aside)."""
        if key in self._pending:
            return self._pending[key]
        for entry in list(self._index.get(key, ())):
            try:
                handle = self._handles.get(entry.shard)
                if handle is None:
                    handle = self._handles[entry.shard] = shards.open_shard(
                        self.directory, entry.shard
                    )
                tensors = shards.read_entry(handle, entry)
            except (CorruptShardError, *shards.READ_ERRORS) as err:
                self._drop_shard(entry.shard, str(err))
                if move_aside and isinstance(err, shards.DAMAGE_ERRORS):
                    shards.move_aside(self.directory, entry.shard)
                    self._moved.add(entry.shard)
                continue
            self.stats.bytes_read += sum(t.nbytes for t in tensors.values())
            return tensors
        return None

    def _drop_shard(self, name: str, why: str) -> None:
        """Forget a damaged shard so none of its entries is served again in this process."""
        shards.warn_corrupt(self.directory, name, why)
        self.stats.corrupt_shards += 1
        self.damaged.add(name)
        self._handles.pop(name, None)
        self._shard_bytes.pop(name, None)
        for entries in self._index.values():
            entries[:] = [e for e in entries if e.shard != name]


def split_batch(output: BatchOutput, n: int) -> list[Tensors]:
    """One dict per sample from ``fn``'s output (a list of dicts or a dict of batched tensors)."""
    if isinstance(output, Mapping):
        for name, tensor in output.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or len(tensor) != n:
                raise ValueError(
                    f"batched output {name!r} must be a tensor with {n} rows (one per missing "
                    f"key), got {getattr(tensor, 'shape', type(tensor))}"
                )
        return [{name: t[i] for name, t in output.items()} for i in range(n)]
    items = list(output)
    if len(items) != n:
        raise ValueError(
            f"the compute function returned {len(items)} results for {n} missing keys; "
            "return one dict per key, in order"
        )
    return [dict(item) for item in items]


def _key(key: Hashable) -> str:
    if isinstance(key, os.PathLike):
        return os.fspath(key)
    if isinstance(key, str):
        return key
    if isinstance(key, numbers.Integral):  # also numpy / torch integer indices
        return str(int(key))
    raise ValueError(f"cache keys must be str, int or a path, got {type(key).__name__}: {key!r}")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB ({nbytes} bytes)"
