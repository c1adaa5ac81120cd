"""`litegen cache build` sharded over 2 gloo ranks on the CPU, started as `litegen launch` starts
them: the same cache as one process, all hits when run again, and a build that failed midway
finished by a rerun that encodes only what is missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from litegen.cache import TensorCache, fingerprint
from litegen.entry import load_entry
from tests.cache_entry import make_recipe

pytestmark = pytest.mark.slow

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TIMEOUT_S = 300
NUM_DIGITS = 1797  # scikit-learn's digits


def cache_build(*args: str | Path, cwd: Path) -> tuple[int, str]:
    """Run `litegen cache build ARGS` as its own process, as a user would; (exit code, output)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    command = [sys.executable, "-m", "litegen_cli.app", "cache", "build", *map(str, args)]
    try:
        proc = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"cache build did not finish in {TIMEOUT_S}s:\n{str(err.output)[-4000:]}")
    return proc.returncode, proc.stdout + proc.stderr


def row(output: str, name: str) -> str:
    """The value column of the report table's row ``name``."""
    found = re.search(rf"^[│|]\s*{re.escape(name)}\s*[│|]\s*(.*?)\s*[│|]$", output, re.M)
    assert found, f"no row {name!r} in:\n{output}"
    return found.group(1)


def contents(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every entry of the one fingerprint folder under ``root``."""
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    cache = TensorCache(root, folder.name)
    stored = cache.keys()  # TensorCache is no mapping: no iteration over it
    return {key: cache.get(key) for key in stored}


def test_two_ranks_fill_the_cache_one_process_fills(tmp_path):
    DigitsAutoencoder = load_entry(str(RECIPES / "digits_autoencoder.py")).DigitsAutoencoder
    # Untrained weights encode as deterministically as trained ones, without stage 1's run.
    torch.manual_seed(0)
    checkpoint = tmp_path / "autoencoder.pth"
    torch.save(DigitsAutoencoder().state_dict(), checkpoint)
    recipe = RECIPES / "digits_latent_dit.yaml"  # launch.nproc_per_node: 2
    settings = [f"autoencoder.checkpoint={checkpoint}", "latent_cache.dtype=float32"]

    # Both builds in a process of their own with one thread and the same batch size: the
    # latents are then bitwise equal whichever rank encodes them.
    code, out = cache_build(recipe, *settings, f"latent_cache.root={tmp_path / 'one'}",
                            "--nproc", "1", cwd=tmp_path)  # fmt: skip
    assert code == 0, out[-4000:]
    assert row(out, "ranks") == "1"
    assert row(out, "misses (encoded now)") == str(NUM_DIGITS)

    two = [*settings, f"latent_cache.root={tmp_path / 'two'}"]
    code, out = cache_build(recipe, *two, cwd=tmp_path)
    assert code == 0, out[-4000:]
    assert row(out, "ranks") == "2"
    assert (row(out, "hits (already cached)"), row(out, "misses (encoded now)")) == (
        "0",
        str(NUM_DIGITS),
    )
    assert row(out, "entries in cache") == str(NUM_DIGITS)
    shards = sorted(p.name for p in (tmp_path / "two").glob("*/*.safetensors"))
    assert len(shards) == 2  # one per rank

    # Same fingerprint folder, same keys, equal tensors.
    assert [p.name for p in (tmp_path / "one").iterdir()] == [
        p.name for p in (tmp_path / "two").iterdir()
    ]
    expected, got = contents(tmp_path / "one"), contents(tmp_path / "two")
    assert got.keys() == expected.keys() == {str(i) for i in range(NUM_DIGITS)}
    assert all(torch.equal(got[k]["latent"], expected[k]["latent"]) for k in expected)

    code, out = cache_build(recipe, *two, cwd=tmp_path)
    assert code == 0, out[-4000:]
    assert (row(out, "hits (already cached)"), row(out, "misses (encoded now)")) == (
        str(NUM_DIGITS),
        "0",
    )
    assert row(out, "bytes written").startswith("0 ")
    assert sorted(p.name for p in (tmp_path / "two").glob("*/*.safetensors")) == shards


def test_a_failed_build_resumes_encoding_only_what_is_missing(tmp_path):
    recipe = make_recipe(tmp_path)  # 2 ranks on the CPU
    cache_root = tmp_path / "cache"

    def encoded() -> int:
        calls = cache_root / "calls.txt"
        return sum(int(n) for n in calls.read_text().split()) if calls.exists() else 0

    # Rank 1 encodes [1, 3], [5, 7], then fails on [9, 11]; what it encoded is kept.
    code, out = cache_build(recipe, "fail_on=9", "--batch-size", "2", cwd=tmp_path)
    assert code == 1, out[-4000:]
    flat = " ".join(out.split())
    assert "Cache build failed" in flat
    assert "rank 1: exit code 1: RuntimeError: cannot encode sample 9" in flat
    assert "Run the same command again" in flat
    cache = TensorCache(cache_root, fingerprint(None, version=1), dtype=None)
    kept = cache.keys()
    assert {"1", "3", "5", "7"} <= kept and "9" not in kept  # rank 0's share may be kept too
    before = encoded()

    code, out = cache_build(recipe, "--batch-size", "2", "fail_on=-1", cwd=tmp_path)
    assert code == 0, out[-4000:]
    hits, misses = int(row(out, "hits (already cached)")), int(row(out, "misses (encoded now)"))
    assert (hits, misses) == (len(kept), 12 - len(kept))
    assert encoded() - before == misses  # only what was missing was encoded
    cache.refresh()
    assert cache.keys() == {str(i) for i in range(12)}
    assert all(cache.get(i)["z"].tolist() == [2.0 * i] * 3 for i in range(12))
