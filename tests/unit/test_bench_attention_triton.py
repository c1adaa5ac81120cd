"""``scripts/bench_attention_triton.py --check``: its kernels match torch's SDPA (Triton's CPU
interpreter), so the figures it records in docs/benchmarks.md time a correct kernel.

    uv run pytest tests/unit/test_bench_attention_triton.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_attention_triton.py"


def test_triton_attention_forward_and_backward_match_sdpa(triton_interpreter):
    assert "max abs errors" in triton_interpreter(str(SCRIPT), "--check")
