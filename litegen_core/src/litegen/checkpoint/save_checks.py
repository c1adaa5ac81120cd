"""What a run checkpoint save refuses, and how a failed one reads.

Nothing non-finite is ever written: the state is checked before its first byte is written (each
rank its own shards). A write that fails (a full disk above all) becomes one short error that
says so first, with the folder, the free space there and the last good checkpoint, instead of
DCP's report of every rank's traceback.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_SHOWN = 3  # non-finite tensors named per rank
_NEARLY_FULL = 1 << 20  # bytes free below which a failed write is taken for a full disk


def last_good_note(last_good: Path | None) -> str:
    """The sentence an aborted save or run ends with.

    >>> last_good_note(Path("results/dit/step_500"))
    'The last good checkpoint is results/dit/step_500 (litegen resume --from results/dit/step_500).'
    """
    if last_good is None:
        return "No checkpoint of this run was written before it."
    return f"The last good checkpoint is {last_good} (litegen resume --from {last_good})."


def nonfinite_entries(state: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in ``state`` (this rank's shards) that hold
    a NaN or inf; one device sync per device.

    >>> nonfinite_entries({"model": {"w": torch.tensor([1.0, float("nan")])}})
    ['model.w']
    """
    tensors = dict(_local_float_tensors(state, prefix))
    by_device: dict[torch.device, list[str]] = {}
    for name, tensor in tensors.items():
        by_device.setdefault(tensor.device, []).append(name)
    bad = []
    for names in by_device.values():
        finite = torch.stack([torch.isfinite(tensors[name]).all() for name in names]).tolist()
        bad += [name for name, ok in zip(names, finite, strict=True) if not ok]
    return bad


def _local_float_tensors(state: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, Mapping):
        for key, value in state.items():
            yield from _local_float_tensors(value, f"{prefix}{key}.")
    elif isinstance(state, list | tuple):
        for i, value in enumerate(state):
            yield from _local_float_tensors(value, f"{prefix}{i}.")
    elif isinstance(state, torch.Tensor):
        if hasattr(state, "to_local"):  # a DTensor: this rank's shard
            state = state.to_local()
        elif hasattr(state, "local_shards"):  # a ShardedTensor
            for i, shard in enumerate(state.local_shards()):
                yield from _local_float_tensors(shard.tensor, f"{prefix}shard{i}.")
            return
        if state.is_floating_point() and state.numel():
            yield prefix.rstrip("."), state


def check_finite(states: list[dict[str, Any]], step: int, last_good: Path | None) -> None:
    """Raise FloatingPointError on every rank when any rank's state to save is not finite.

    A collective: every rank calls it with its own ``states`` (one per trainable model).
    """
    mine = [
        name
        for i, state in enumerate(states)
        for name in nonfinite_entries(state, f"model_{i}." if len(states) > 1 else "")
    ]
    found: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine[:_SHOWN])
    named = sorted({name for part in found for name in part or []})
    if named:
        raise FloatingPointError(
            f"the state to save at step {step} is not finite ({', '.join(named[:_SHOWN])}); "
            f"nothing of it was saved. {last_good_note(last_good)}"
        )


def write_failure(err: BaseException, folder: Path, step: int, last_good: Path | None) -> OSError:
    """One short error for a save of ``step`` into ``folder`` that failed with ``err``.

    A full disk is named first ("No space left on device"), with the free space left there.

    >>> write_failure(OSError(28, "No space left on device"), Path("results"), 6, None)
    OSError('No space left on device: writing run checkpoint step_6 into results failed (... free ...
    """
    cause = _first_cause(err)
    usage = _disk_usage(folder)
    # torch.save reports a full disk only as "file write failed": the free space tells.
    full = any(_is_full_disk(e) for e in _causes(err)) or (usage and usage.free < _NEARLY_FULL)
    head = "No space left on device: " if full else ""
    free = (
        f"{_size(usage.free)} free of {_size(usage.total)} there" if usage else "free space unknown"
    )
    return OSError(
        f"{head}writing run checkpoint step_{step} into {folder} failed "
        f"({free}; {type(cause).__name__}: {_first_line(cause)}). {last_good_note(last_good)}"
    )


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, what it was raised from, and the per-rank errors of DCP's CheckpointException."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                todo.append(value[0] if isinstance(value, tuple) else value)
        todo += [current.__cause__, current.__context__]


def _is_full_disk(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(err)


def _first_cause(err: BaseException) -> BaseException:
    """The deepest error that says something of its own (not DCP's wrapper)."""
    causes = [e for e in _causes(err) if not hasattr(e, "failures")]
    full = [e for e in causes if _is_full_disk(e)]
    return (full or causes or [err])[0]


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else ""


def _disk_usage(folder: Path) -> Any:
    for where in (folder, *folder.parents):
        if where.exists():
            return shutil.disk_usage(where)
    return None


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
