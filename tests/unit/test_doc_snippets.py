"""Code the docs show, run as written (the blocks are read from the pages)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def blocks(page: str, heading: str, language: str) -> list[str]:
    """The ``language`` code blocks of ``page`` under ``heading``, up to the next heading."""
    text = (DOCS / page).read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_diffusers_frozen_vae_beside_the_trained_model(in_tmp):
    yaml = blocks("diffusers.md", "## The library path: two lines", "yaml")[0]
    (in_tmp / "dit.yaml").write_text(yaml.replace("global_batch_size: 32", "global_batch_size: 2"))
    (code,) = blocks(
        "diffusers.md", "## Frozen models: a VAE or text encoder beside the trained one", "python"
    )
    exec(compile(code, "diffusers.md", "exec"), {})
