"""Run a function on N gloo ranks in fresh processes, the way torchrun would start them.

Each rank gets the torchrun environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE), so ``litegen.initialize`` joins a real process group. Return values come
back pickled through files; a rank's exception is re-raised in the test with its traceback.

A rank that dies from SIGSEGV, SIGBUS or SIGABRT without raising gets its whole group run once
more, with a warning: once in several CI runs, a forked gloo rank crashed inside torch's
``wait_tensor`` while gathering a full state dict (torch 2.13, never reproduced in dozens of
reruns), and once glibc aborted a rank of the HSDP EMA test on "double free or corruption"
(passed in three reruns). A crash that happens again fails the test; other deaths (SIGKILL,
``os._exit``) are not retried, since tests cause them on purpose.

Example:
    >>> def fn(scale):  # module level, so the spawned process can import it
    ...     import torch.distributed as dist
    ...     return dist.get_rank() * scale
    >>> run_ranks(fn, 2, 10)  # doctest: +SKIP
    [0, 10]
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240
# Signals of a crash inside native code, as opposed to a kill a test (or the harness) sends.
CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGABRT")


class RankError(RuntimeError):
    """A rank raised; the message carries every failing rank's traceback."""


class RankCrash(RankError):
    """A rank died from one of :data:`CRASH_SIGNALS` without raising."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    fn: Callable[..., Any],
    args: tuple,
    world_size: int,
    local_world_size: int,
    port: int,
    out_dir: str,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local_world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK=str(rank // local_world_size),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    import torch
    import torch.distributed as dist

    # Several ranks share few CPU cores in CI; one thread each avoids oversubscription.
    torch.set_num_threads(1)
    if dist.is_initialized():
        # Forked from a test process that left a (one-rank) group behind: this rank must
        # join the new job's group, not keep the parent's.
        dist.destroy_process_group()
    path = Path(out_dir, f"rank{rank}.pkl")
    tmp = Path(out_dir, f".rank{rank}.tmp")
    try:
        result = ("ok", fn(*args))
    except BaseException as err:  # report everything, including KeyboardInterrupt in a rank
        result = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    try:
        payload = pickle.dumps(result)
    except Exception as err:
        payload = pickle.dumps(("error", f"rank {rank} returned an unpicklable value: {err}"))
    # Write then rename, so the parent's polling never reads a half-written result.
    tmp.write_bytes(payload)
    os.replace(tmp, path)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    local_world_size: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_method: str | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks; return each rank's result, in rank order.

    ``start_method`` defaults to ``fork`` on Linux: the ranks inherit the already imported torch
    instead of importing it again (seconds per rank on small CI machines). Pass ``"spawn"`` for
    CUDA, which cannot be used in a forked child. With ``spawn``, ``fn`` and ``args`` must be
    picklable (``fn`` defined at module level). ``local_world_size``
    below ``world_size`` simulates several nodes on this machine (``nnodes =
    world_size // local_world_size``), as ``torchrun --nnodes 2`` on localhost would.

    Example:
        >>> run_ranks(train_and_return_losses, 2, {"optimization": {...}})  # doctest: +SKIP
    """
    local_world_size = local_world_size or world_size
    if world_size % local_world_size:
        raise ValueError(
            f"world_size={world_size} must be a multiple of local_world_size={local_world_size}."
        )
    start_method = start_method or _default_start_method()
    if start_method == "fork":
        _preload()
    launch = (fn, args, world_size, local_world_size, timeout_s, start_method)
    try:
        return _run_once(*launch)
    except RankCrash as crash:
        warnings.warn(
            f"{crash}\nRunning the ranks once more (see the harness docstring).", stacklevel=2
        )
        return _run_once(*launch)


def _run_once(
    fn: Callable[..., Any],
    args: tuple,
    world_size: int,
    local_world_size: int,
    timeout_s: float,
    start_method: str,
) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="litegen_ranks_") as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(fn, args, world_size, local_world_size, free_port(), out_dir),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            # Poll rather than block: when one rank fails, the others usually hang in a
            # collective, so report the failure at once instead of waiting for gloo's timeout.
            while not ctx.join(timeout=0.5):
                if _any_error(out_dir, world_size):
                    _raise_errors(out_dir, world_size)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{world_size} ranks did not finish in {timeout_s:.0f}s; results from "
                        f"ranks {_finished(out_dir, world_size)}."
                    )
        except mp.ProcessExitedException as err:
            # A rank died without writing a result (segfault, os._exit): nothing to unpickle.
            _raise_errors(out_dir, world_size, extra=str(err), crashed=err.signal_name)
            raise
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return _collect(out_dir, world_size)


def _preload() -> None:
    """Import the heavy modules once in the parent, so forked ranks inherit them.

    ``torch.distributed.checkpoint`` alone takes several seconds to import on a small machine,
    and every rank would pay it again inside ``litegen.initialize``.
    """
    import torch.distributed.checkpoint
    import torch.distributed.fsdp  # noqa: F401

    import litegen.runtime.litegen  # noqa: F401


def _default_start_method() -> str:
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _read(out_dir: str, rank: int) -> tuple[str, Any] | None:
    path = Path(out_dir, f"rank{rank}.pkl")
    return pickle.loads(path.read_bytes()) if path.is_file() else None


def _finished(out_dir: str, world_size: int) -> list[int]:
    return [r for r in range(world_size) if Path(out_dir, f"rank{r}.pkl").is_file()]


def _any_error(out_dir: str, world_size: int) -> bool:
    return any((_read(out_dir, r) or ("ok",))[0] == "error" for r in _finished(out_dir, world_size))


def _raise_errors(
    out_dir: str, world_size: int, extra: str = "", crashed: str | None = None
) -> None:
    """Raise for the ranks that died or raised; ``crashed`` names the signal a rank died from."""
    died, raised = [], []
    for rank in range(world_size):
        result = _read(out_dir, rank)
        if result is None:
            died.append(f"--- rank {rank}: no result (process died) ---")
        elif result[0] == "error":
            raised.append(f"--- rank {rank} ---\n{result[1]}")
    if died or raised:
        message = "\n".join(raised + died) + (f"\n{extra}" if extra else "")
        # Only a crash with no Python error anywhere is worth a second run.
        error = RankCrash if crashed in CRASH_SIGNALS and not raised else RankError
        raise error(message)


def _collect(out_dir: str, world_size: int) -> list[Any]:
    _raise_errors(out_dir, world_size)
    return [_read(out_dir, rank)[1] for rank in range(world_size)]
