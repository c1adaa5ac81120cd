"""The python blocks of docs/finetune.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.pipelines import tiny_pipeline_folder

DOC = Path(__file__).resolve().parents[2] / "docs" / "finetune.md"
RECIPES = "\n## Recipes"  # its code loads a run's results: test_finetune_recipes.py runs it
BEFORE_RECIPES = DOC.read_text(encoding="utf-8").split(RECIPES)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", BEFORE_RECIPES, flags=re.DOTALL)


def test_the_page_has_code() -> None:
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for family in ("wan", "flux"):
        if f"tiny_{family}" in BLOCKS[index]:  # the folder litegen_zoo/make_tiny_pipeline.py writes
            (tmp_path / f"tiny_{family}").symlink_to(tiny_pipeline_folder(family))
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[index], f"{DOC.name} block {index}", "exec"), {})
