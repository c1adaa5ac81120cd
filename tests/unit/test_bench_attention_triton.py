"""``scripts/bench_attention_triton.py --check``: its kernels match torch's SDPA (Triton's CPU
interpreter), so the figures it records in docs/benchmarks.md time a correct kernel.

    uv run pytest tests/unit/test_bench_attention_triton.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_attention_triton.py"


def test_triton_attention_forward_and_backward_match_sdpa():
    # The interpreter is chosen when the kernels are defined, so it needs a fresh process.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "max abs errors" in run.stdout
