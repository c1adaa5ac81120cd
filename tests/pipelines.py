"""Tiny diffusers pipeline folders for tests, written once per test process by
litegen_zoo/make_tiny_pipeline.py. Treat them as read-only: copy one before changing it."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from litegen_zoo.make_tiny_pipeline import make_tiny_pipeline


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="litegen-tiny-pipelines-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tiny_pipeline_folder(family: str) -> Path:
    """The tiny pipeline folder of ``family`` (wan, flux), shared by the tests of a process."""
    return make_tiny_pipeline(family, _root() / family)
