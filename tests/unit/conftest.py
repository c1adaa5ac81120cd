"""Unit tests run LiteGen as one plain process; each test leaves no process group behind."""

from __future__ import annotations

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
