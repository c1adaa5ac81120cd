"""`litegen cache build RECIPE`: fills a recipe's cache through its build_cache hook.

In one process (``--nproc 1``) here; the sharded build's ranks run in
tests/distributed/test_cache_build.py, and only its plumbing (no rank started) is checked here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from litegen.cache import TensorCache
from litegen_cli.app import app
from tests.cache_entry import make_recipe

runner = CliRunner()
WIDE = {"COLUMNS": "250"}  # rich wraps at 80 columns otherwise


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def build(*args: str, nproc: int | None = 1):
    """`litegen cache build ARGS --nproc N`; ``nproc=None`` keeps the recipe's (2 ranks)."""
    ranks = [] if nproc is None else ["--nproc", str(nproc)]
    return runner.invoke(app, ["cache", "build", *map(str, args), *ranks], env=WIDE)


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting ranks fails the test: what it checks must happen before."""
    import litegen_cli.launcher

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(litegen_cli.launcher, "run_ranks", refuse)


def encode_calls(tmp_path: Path) -> list[int]:
    calls = tmp_path / "cache" / "calls.txt"
    return [int(n) for n in calls.read_text().split()] if calls.exists() else []


def stored(tmp_path: Path, version: int = 1) -> TensorCache:
    from litegen.cache import fingerprint

    return TensorCache(tmp_path / "cache", fingerprint(None, version=version))


def row(output: str, name: str) -> str:
    """The value column of the report table's row ``name``."""
    found = re.search(rf"^[│|]\s*{re.escape(name)}\s*[│|]\s*(.*?)\s*[│|]$", output, re.M)
    assert found, f"no row {name!r} in:\n{output}"
    return found.group(1)


def test_build_fills_then_hits(tmp_path):
    recipe = make_recipe(tmp_path)
    result = build(recipe, "--batch-size", "5")
    assert result.exit_code == 0, result.output
    assert row(result.output, "misses (encoded now)") == "12"
    assert row(result.output, "hits (already cached)") == "0"
    assert row(result.output, "ranks") == "1"
    assert row(result.output, "bytes written").startswith("72 ")  # 12 x 3 bf16 values
    assert encode_calls(tmp_path) == [5, 5, 2]  # --batch-size reached fill_cache
    cache = stored(tmp_path)
    assert len(cache) == 12
    assert cache.get(7)["z"].tolist() == [14.0, 14.0, 14.0]

    again = build(recipe)
    assert again.exit_code == 0, again.output
    assert row(again.output, "hits (already cached)") == "12"
    assert row(again.output, "misses (encoded now)") == "0"
    assert row(again.output, "bytes written").startswith("0 ")
    assert encode_calls(tmp_path) == [5, 5, 2]  # nothing encoded the second time


def test_a_build_stopped_midway_keeps_what_it_encoded(tmp_path):
    """The batches encoded before a failure are written; the rerun encodes only the rest."""
    recipe = make_recipe(tmp_path)
    failed = build(recipe, "--batch-size", "5", "fail_on=7")
    assert failed.exit_code != 0
    assert isinstance(failed.exception, RuntimeError)
    assert stored(tmp_path).keys() == {str(i) for i in range(5)}
    assert encode_calls(tmp_path) == [5]

    result = build(recipe, "--batch-size", "5")
    assert result.exit_code == 0, result.output
    assert row(result.output, "hits (already cached)") == "5"
    assert row(result.output, "misses (encoded now)") == "7"
    assert encode_calls(tmp_path) == [5, 5, 2]  # then [5..9] and [10, 11]; [0..4] was skipped
    assert len(stored(tmp_path)) == 12


def test_a_zeroed_shard_is_re_encoded_by_the_next_build(tmp_path):
    recipe = make_recipe(tmp_path)
    assert build(recipe).exit_code == 0
    (shard,) = stored(tmp_path).directory.glob("*.safetensors")
    shard.write_bytes(bytes(shard.stat().st_size))  # same size: only reading it back tells
    with pytest.warns(RuntimeWarning, match="damaged"):
        result = build(recipe)
    assert result.exit_code == 0, result.output
    assert row(result.output, "hits (already cached)") == "0"
    assert row(result.output, "misses (encoded now)") == "12"
    assert row(result.output, "damaged shards (moved aside)") == "1"
    again = build(recipe)
    assert row(again.output, "hits (already cached)") == "12"
    assert row(again.output, "damaged shards (moved aside)") == "0"
    assert stored(tmp_path).get(7)["z"].tolist() == [14.0, 14.0, 14.0]


def test_overrides_reach_the_hook(tmp_path):
    """A changed setting (here the fingerprint's version) fills a new namespace."""
    recipe = make_recipe(tmp_path)
    assert build(recipe).exit_code == 0
    result = build(recipe, "version=2")
    assert result.exit_code == 0, result.output
    assert row(result.output, "misses (encoded now)") == "12"
    assert len(stored(tmp_path, version=2)) == 12


def test_keys_from_the_hook_name_the_entries(tmp_path):
    recipe = make_recipe(tmp_path, hook="([f'item-{i}' for i in range(12)],)")
    result = build(recipe)
    assert result.exit_code == 0, result.output
    assert stored(tmp_path).keys() == {f"item-{i}" for i in range(12)}


def test_entry_without_hook_exits_2_with_the_fix(tmp_path):
    recipe = make_recipe(tmp_path, hook=None)
    result = build(recipe)
    assert result.exit_code == 2
    assert "defines no build_cache(config)" in result.output
    assert "(cache, dataset, encode_fn[, keys])" in result.output


def test_hook_returning_five_items_exits_2(tmp_path):
    recipe = make_recipe(tmp_path, hook="(1, 2)")
    result = build(recipe)
    assert result.exit_code == 2
    assert "or (cache, dataset, encode_fn, keys), got a tuple of 5" in result.output


def test_hook_returning_no_cache_exits_2(tmp_path):
    entry = tmp_path / "nocache.py"
    entry.write_text(
        "def build(config): ...\n"
        "def train_step(batch): ...\n"
        "def build_cache(config):\n"
        "    return {}, [1, 2], len\n"
    )
    recipe = make_recipe(tmp_path)
    data = yaml.safe_load(recipe.read_text())
    data["launch"]["entry"] = "nocache.py"
    recipe.write_text(yaml.safe_dump(data))
    result = build(recipe)
    assert result.exit_code == 2
    assert "must be a litegen.cache.TensorCache, got dict" in result.output


def test_bad_recipe_exits_2_before_importing(tmp_path):
    result = build(tmp_path / "missing.yaml")
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_bad_recipe_exits_2_before_any_rank_starts(tmp_path, no_ranks):
    recipe = make_recipe(tmp_path)
    result = build(recipe, "optimization.parallel.strategy=nope", nproc=None)
    assert result.exit_code == 2
    assert "optimization.parallel.strategy" in result.output


def test_entry_without_hook_exits_2_before_any_rank_starts(tmp_path, no_ranks):
    recipe = make_recipe(tmp_path, hook=None)
    result = build(recipe, nproc=None)
    assert result.exit_code == 2
    assert "defines no build_cache(config)" in result.output


@pytest.mark.parametrize(("nproc", "ranks"), [(None, 2), (3, 3)])
def test_the_ranks_get_the_recipes_nproc_and_the_batch_size(tmp_path, monkeypatch, nproc, ranks):
    """--nproc (default: launch.nproc_per_node) ranks, each started in the worker's cache-build
    mode; the table is the report rank 0 wrote."""
    import litegen_cli.launcher
    from litegen_cli.recipe import load_recipe
    from litegen_cli.worker import _parse

    started = []

    def fake_run_ranks(recipe, resolved, worker_args=()):
        args = _parse([str(resolved), *worker_args])
        started.append((recipe.launch.nproc_per_node, args.batch_size))
        assert load_recipe(args.recipe).launch.nproc_per_node == ranks
        report = {"directory": "d", "samples": 12, "hits": 5, "misses": 7, "bytes_written": 42,
                  "total_entries": 12, "total_bytes": 99, "seconds": 0.5, "ranks": ranks}  # fmt: skip
        args.cache_report.write_text(json.dumps(report))

    monkeypatch.setattr(litegen_cli.launcher, "run_ranks", fake_run_ranks)
    result = build(make_recipe(tmp_path), "--batch-size", "5", nproc=nproc)
    assert result.exit_code == 0, result.output
    assert started == [(ranks, 5)]
    assert row(result.output, "ranks") == str(ranks)
    assert row(result.output, "misses (encoded now)") == "7"
