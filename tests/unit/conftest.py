"""Unit tests run LiteGen as one plain process; each test leaves no process group behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist


@pytest.fixture
def group():
    """A one-rank gloo process group, for code that needs one initialised (DDP, collectives)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


@pytest.fixture(autouse=True)
def _fresh_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def triton_interpreter():
    """Runs ``python ARGS`` under Triton's CPU interpreter and returns its stdout once it exits 0.

    The interpreter is chosen when kernels are defined, so it needs a fresh process.
    """

    def run(*args: str) -> str:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return done.stdout

    return run
