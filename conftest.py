"""Every ``>>>`` example in the two source trees runs as a doctest.

``uv run pytest`` collects them with the tests (``testpaths`` in pyproject.toml);
``uv run pytest litegen_core/src litegen_cli/src`` runs only them. Each example runs in its own
temporary working directory, so relative paths it writes land there. A module that needs an
optional extra that is not installed is skipped, not failed.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from _pytest.doctest import DoctestItem, DoctestModule

ROOT = Path(__file__).resolve().parent
SOURCE_TREES = (ROOT / "litegen_core" / "src", ROOT / "litegen_cli" / "src")

# Top-level imports of the optional extras (litegen_core's optional-dependencies, GPU-node
# builds and Triton, which CPU-only PyTorch wheels may lack).
OPTIONAL_IMPORTS = frozenset(
    {
        "apex",
        "av",
        "diffusers",
        "flash_attn",
        "omegaconf",
        "peft",
        "PIL",
        "tensorboard",
        "torchao",
        "torchdata",
        "triton",
        "wandb",
    }
)


class SourceDoctests(DoctestModule):
    """The doctests of one source module, skipped when it needs a missing optional extra."""

    missing_extra: str | None = None

    def collect(self):
        if self.missing_extra is not None:
            pytest.skip(f"{self.path.name} needs the optional package {self.missing_extra!r}")
        yield from super().collect()


def _module_name(file_path: Path, tree: Path) -> str:
    parts = file_path.relative_to(tree).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.suffix != ".py" or file_path.name == "__main__.py":
        return None
    if parent.config.option.doctestmodules:
        return None  # --doctest-modules collects them already
    tree = next((t for t in SOURCE_TREES if file_path.is_relative_to(t)), None)
    if tree is None:
        return None
    collector = SourceDoctests.from_parent(parent, path=file_path)
    try:
        importlib.import_module(_module_name(file_path, tree))
    except ModuleNotFoundError as missing:
        top = (missing.name or "").partition(".")[0]
        if top not in OPTIONAL_IMPORTS:
            raise
        collector.missing_extra = top
    return collector


@pytest.fixture(autouse=True)
def _doctest_in_tmp_dir(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if isinstance(request.node, DoctestItem):
        monkeypatch.chdir(request.getfixturevalue("tmp_path"))
