"""A tiny entry module with a ``build_cache`` hook, and a recipe around it, for the tests of
``litegen cache build`` (one process in tests/unit, ranks in tests/distributed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

# A tiny entry module: 12 vectors "encoded" by doubling them; sample fail_on cannot be encoded.
# It counts its encode calls in a file, so a test can tell whether a second build encoded
# anything.
ENTRY = """
import torch
from pathlib import Path
from litegen.cache import TensorCache, fingerprint

def build(config):
    raise AssertionError("cache build must not call build()")

def train_step(batch, model):
    raise AssertionError("cache build must not train")

def build_cache(config):
    cache = TensorCache(config.cache_root, fingerprint(None, version=config.version))
    dataset = [torch.full((3,), float(i)) for i in range(12)]
    calls = Path(config.cache_root) / "calls.txt"

    def encode_fn(samples):
        if any(int(s[0]) == config.fail_on for s in samples):
            raise RuntimeError(f"cannot encode sample {config.fail_on}")
        with calls.open("a") as fh:
            fh.write(f"{len(samples)}\\n")
        return {"z": torch.stack(samples) * 2}

    return (cache, dataset, encode_fn, *HOOK_EXTRA)
"""


def make_recipe(tmp_path: Path, hook: str | None = "()", name: str = "cache_entry") -> Path:
    """A recipe whose entry defines build_cache returning (cache, dataset, encode_fn, *hook)."""
    code = ENTRY.replace("HOOK_EXTRA", hook or "()")
    if hook is None:  # no hook at all
        code = code[: code.index("def build_cache")]
    entry = tmp_path / f"{name}.py"
    entry.write_text(textwrap.dedent(code))
    data = {
        "launch": {"entry": entry.name, "nproc_per_node": 2},
        "exp_name": "tiny",
        "results_dir": str(tmp_path / "results"),
        "runtime": {"device": "cpu"},
        "max_steps": 1,
        "global_batch_size": 4,
        "cache_root": str(tmp_path / "cache"),
        "version": 1,
        "fail_on": -1,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
