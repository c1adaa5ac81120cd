"""`litegen cache build RECIPE`: fill a recipe's tensor cache ahead of training.

The recipe's entry module defines the hook (see docs/cli.md)::

    def build_cache(config) -> tuple[TensorCache, dataset, encode_fn]          # or
    def build_cache(config) -> tuple[TensorCache, dataset, encode_fn, keys]

and this module runs ``litegen.cache.fill_cache`` over the whole dataset in this one process
(rank 0 of 1). torch is imported only when a cache is built, so the CLI stays fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from litegen_cli.recipe import Recipe

HOOK = "build_cache"


@dataclass
class CacheReport:
    """What one fill did: ``misses`` samples encoded, ``hits`` found already cached."""

    directory: str
    samples: int
    hits: int
    misses: int
    bytes_written: int
    total_entries: int
    total_bytes: int
    seconds: float


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


def build_recipe_cache(recipe: Recipe, batch_size: int = 64) -> CacheReport:
    """Import the recipe's entry module, call its ``build_cache(config)`` hook and fill the cache.

    Raises ValueError (saying how to fix it) when the entry has no hook or it returns
    something unusable.

    Example::

        report = build_recipe_cache(load_recipe("recipes/digits_latent_dit.yaml"))
        report.misses, report.hits
    """
    from litegen.cache import fill_cache
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
    cache, dataset, encode_fn, keys = _unpack(hook(recipe.config), entry)
    start = time.perf_counter()
    # One process: rank 0 of 1 encodes everything the cache lacks.
    encoded = fill_cache(
        cache, dataset, encode_fn, keys=keys, batch_size=batch_size, rank=0, world_size=1
    )
    return CacheReport(
        directory=str(cache.directory),
        samples=len(dataset),
        hits=len(dataset) - encoded,
        misses=encoded,
        bytes_written=cache.stats.bytes_written,
        total_entries=len(cache),
        total_bytes=cache.total_bytes,
        seconds=time.perf_counter() - start,
    )


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
        ("hits (already cached)", str(report.hits)),
        ("misses (encoded now)", str(report.misses)),
        ("bytes written", f"{report.bytes_written} ({report.bytes_written / 2**20:.2f} MiB)"),
        ("entries in cache", str(report.total_entries)),
        ("bytes on disk", f"{report.total_bytes} ({report.total_bytes / 2**20:.2f} MiB)"),
        ("time", f"{report.seconds:.2f} s"),
    ]
    for name, value in rows:
        table.add_row(name, escape(value))
    return table
