"""`litegen cache build RECIPE`: fill a recipe's tensor cache ahead of training.

The recipe's entry module defines the hook (see docs/cli.md)::

    def build_cache(config) -> tuple[TensorCache, dataset, encode_fn]          # or
    def build_cache(config) -> tuple[TensorCache, dataset, encode_fn, keys]

and ``litegen.cache.fill_cache`` encodes every sample the cache lacks. Every entry counted as
a hit is read back and checked against its checksums first: a damaged shard is moved aside and
its entries encoded again. With one rank this
process does it all (:func:`build_recipe_cache`). With N ranks the launcher of ``litegen
launch`` starts them (:func:`build_cache_on_ranks`), each in the worker's cache-build mode
(:func:`fill_rank_share`): rank r calls the hook on its own device and encodes samples
``r, r + N, ...``; rank 0 gathers the counts into the report the CLI prints. torch is imported
only when a cache is built, so the CLI stays fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litegen.checkpoint.atomic import atomic_write_text
from litegen_cli.recipe import Recipe

HOOK = "build_cache"
# The worker's command-line switch into cache-build mode: --cache-build REPORT --batch-size N.
CACHE_BUILD_FLAG = "--cache-build"
REPORT_NAME = "cache_report.json"


@dataclass
class CacheReport:
    """What one fill did, over all its ranks: ``misses`` samples encoded, ``hits`` found
    already cached (read back intact), ``bytes_written`` summed, ``damaged_shards`` found and
    moved aside (their entries re-encoded); ``seconds`` of the slowest rank."""

    directory: str
    samples: int
    hits: int
    misses: int
    bytes_written: int
    total_entries: int
    total_bytes: int
    seconds: float
    ranks: int = 1
    damaged_shards: int = 0


def _unpack(
    result: Any, entry: str
) -> tuple[Any, Any, Callable[[list[Any]], Any], Sequence | None]:
    """Check the hook's return value: (cache, dataset, encode_fn[, keys])."""
    from litegen.cache import TensorCache

    shape = (
        f"{HOOK}(config) in entry module '{entry}' must return (cache, dataset, encode_fn) "
        "or (cache, dataset, encode_fn, keys)"
    )
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise ValueError(f"{shape}, got {got}.")
    cache, dataset, encode_fn = result[:3]
    keys = result[3] if len(result) == 4 else None
    if not isinstance(cache, TensorCache):
        raise ValueError(
            f"{shape}; its first item must be a litegen.cache.TensorCache, got {type(cache).__name__}."
        )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(
            f"{shape}; its dataset must support len() and dataset[i], got {type(dataset).__name__}."
        )
    if not callable(encode_fn):
        raise ValueError(f"{shape}; encode_fn must be callable, got {type(encode_fn).__name__}.")
    return cache, dataset, encode_fn, keys


def load_hook(recipe: Recipe) -> Callable[[Any], Any]:
    """The entry module's ``build_cache`` hook; ValueError (with the fix) when it has none.

    Cheap enough to check before any rank starts: the module is imported, the hook not called.

    Example::

        hook = load_hook(load_recipe("recipes/digits_latent_dit.yaml"))
    """
    from litegen.entry import load_entry

    entry = recipe.launch.entry
    module = load_entry(entry, recipe.base_dir)
    hook = getattr(module, HOOK, None)
    if not callable(hook):
        raise ValueError(
            f"entry module '{entry}' ({getattr(module, '__file__', '?')}) defines no "
            f"{HOOK}(config); add one returning (cache, dataset, encode_fn[, keys]) to fill "
            "its cache ahead of training (see docs/cli.md, `cache build`)."
        )
    return hook


def _fill_share(
    parts: tuple[Any, Any, Callable[[list[Any]], Any], Sequence | None],
    batch_size: int,
    rank: int,
    world_size: int,
) -> dict[str, Any]:
    """Encode this rank's share of what the cache lacks; its counts for the report."""
    from litegen.cache import fill_cache

    cache, dataset, encode_fn, keys = parts
    start = time.perf_counter()
    try:
        # verify: a hit is an entry that reads back intact, so a damaged shard is re-encoded.
        encoded = fill_cache(
            cache, dataset, encode_fn, keys=keys, batch_size=batch_size,
            rank=rank, world_size=world_size, verify=True,
        )  # fmt: skip
    except BaseException:
        # Stopped midway (Ctrl-C, a stop, a sample that fails): keep what this rank already
        # encoded, so the rerun encodes only the rest. The original error is the one to show.
        with contextlib.suppress(Exception):
            cache.flush()
        raise
    share = len(range(rank, len(dataset), world_size))
    return {
        "hits": share - encoded,
        "misses": encoded,
        "bytes_written": cache.stats.bytes_written,
        "damaged_shards": sorted(cache.damaged),
        "seconds": time.perf_counter() - start,
    }


def _report(cache: Any, samples: int, shares: list[dict[str, Any]]) -> CacheReport:
    return CacheReport(
        directory=str(cache.directory),
        samples=samples,
        hits=int(sum(s["hits"] for s in shares)),
        misses=int(sum(s["misses"] for s in shares)),
        bytes_written=int(sum(s["bytes_written"] for s in shares)),
        damaged_shards=len(set().union(*(s["damaged_shards"] for s in shares))),
        total_entries=len(cache),
        total_bytes=cache.total_bytes,
        seconds=max(s["seconds"] for s in shares),
        ranks=len(shares),
    )


def build_recipe_cache(recipe: Recipe, batch_size: int = 64) -> CacheReport:
    """Fill the recipe's cache in this one process (rank 0 of 1, no process group).

    Raises ValueError (saying how to fix it) when the entry has no hook or it returns
    something unusable.

    Example::

        report = build_recipe_cache(load_recipe("recipes/digits_latent_dit.yaml"))
        report.misses, report.hits
    """
    parts = _unpack(load_hook(recipe)(recipe.config), recipe.launch.entry)
    share = _fill_share(parts, batch_size, rank=0, world_size=1)
    return _report(parts[0], len(parts[1]), [share])


def build_cache_on_ranks(recipe: Recipe, nproc: int, batch_size: int = 64) -> CacheReport:
    """Fill the recipe's cache with ``nproc`` ranks on this node, started as ``launch`` starts
    them; returns their summed report.

    Raises ValueError before any rank starts when the entry has no hook, and LaunchFailed
    (one message, the exit code) when a rank fails.

    Example::

        build_cache_on_ranks(load_recipe("recipes/dit_imagenet.yaml"), nproc=8)
    """
    from litegen_cli.launcher import run_ranks, write_resolved_recipe

    load_hook(recipe)
    # This node only: a cache build is no multi-node job, and the cache takes any writers.
    spec = recipe.launch.model_copy(update={"nproc_per_node": nproc, "nnodes": 1, "node_rank": 0})
    on_this_node = dataclasses.replace(recipe, launch=spec)
    # The resolved recipe and the report live in a private folder: the run folder is not ours.
    folder = Path(tempfile.mkdtemp(prefix="litegen-cache-build-"))
    try:
        resolved = write_resolved_recipe(on_this_node, folder)
        report = folder / REPORT_NAME
        run_ranks(
            on_this_node,
            resolved,
            [CACHE_BUILD_FLAG, str(report), "--batch-size", str(batch_size)],
        )
        return CacheReport(**json.loads(report.read_text(encoding="utf-8")))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def fill_rank_share(recipe: Recipe, batch_size: int, report: Path) -> None:
    """One rank of :func:`build_cache_on_ranks` (the worker's cache-build mode).

    Joins the process group on the recipe's ``runtime.device`` (CUDA: this local rank's GPU
    becomes the current device before the hook loads its encoders), encodes this rank's share
    and gathers every rank's counts; rank 0 writes the report to ``report``.

    Example (what each rank runs)::

        python -m litegen_cli.worker RESOLVED --cache-build REPORT --batch-size 64
    """
    import torch.distributed as dist

    from litegen.runtime.distributed import DistEnv, init_process_group, resolve_device

    config = recipe.config
    env = DistEnv.from_environ()
    init_process_group(config, env, resolve_device(config, env))
    # torchrun stops the ranks with SIGTERM (another rank failed, the job was cancelled): as
    # an exception it lets _fill_share keep what was encoded, then the rank ends by the signal.
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        parts = _unpack(load_hook(recipe)(config), recipe.launch.entry)
        share = _fill_share(parts, batch_size, env.rank, env.world_size)
        shares: list[Any] = [None] * env.world_size
        dist.all_gather_object(shares, share)  # every rank has flushed its shards by now
        if env.rank == 0:
            cache = parts[0]
            cache.refresh()  # the other ranks' shards, for the totals on disk
            text = json.dumps(dataclasses.asdict(_report(cache, len(parts[1]), shares)))
            atomic_write_text(report, text)
    except _Stopped:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:  # a stop while the worker records an error ends the rank at once, as in `launch`
        signal.signal(signal.SIGTERM, previous)


class _Stopped(BaseException):
    """SIGTERM received by a cache-build rank (BaseException: no ``except Exception`` eats it)."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped(f"stopped by signal {signum}")


def report_table(report: CacheReport):
    """The fill's outcome as a rich table (hits, misses, bytes, time).

    Example::

        console.print(report_table(build_recipe_cache(recipe)))
    """
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="Tensor cache", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("directory", report.directory),
        ("samples", str(report.samples)),
        ("ranks", str(report.ranks)),
        ("hits (already cached)", str(report.hits)),
        ("misses (encoded now)", str(report.misses)),
        ("damaged shards (moved aside)", str(report.damaged_shards)),
        ("bytes written", f"{report.bytes_written} ({report.bytes_written / 2**20:.2f} MiB)"),
        ("entries in cache", str(report.total_entries)),
        ("bytes on disk", f"{report.total_bytes} ({report.total_bytes / 2**20:.2f} MiB)"),
        ("time", f"{report.seconds:.2f} s"),
    ]
    for name, value in rows:
        table.add_row(name, escape(value))
    return table
