"""Unit tests run LiteGen as one plain process; each test leaves no process group behind."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _fresh_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
