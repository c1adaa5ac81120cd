"""Tiny diffusers pipeline folders for tests, built once per session by scripts/make_tiny_pipeline.py."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def tiny_pipeline_folder(family: str, root: Path) -> Path:
    """``root/<family>``, written on first use: the tiny pipeline of ``family`` (wan, flux)."""
    folder = root / family
    if not (folder / "model_index.json").is_file():
        sys.path.insert(0, str(SCRIPTS))
        try:
            from make_tiny_pipeline import make_tiny_pipeline
        finally:
            sys.path.remove(str(SCRIPTS))
        make_tiny_pipeline(family, folder)
    return folder
