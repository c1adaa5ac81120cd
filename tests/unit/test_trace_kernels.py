"""scripts/trace_kernels.py on a hand-made trace: heaviest kernels and the gaps between them."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from trace_kernels import gaps, heaviest, load_kernels


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_heaviest_kernels_and_gaps_skip_communication(tmp_path: Path):
    events = [
        kernel("gemm", 0, 10),
        kernel("ncclAllReduce", 5, 30),  # its own stream: overlaps, and fills no gap
        kernel("gelu", 12, 3),  # 2 us after gemm
        kernel("gemm", 25, 10),  # 10 us after gelu
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
    ]
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))

    kernels = load_kernels(path)
    assert [e["name"] for e in kernels] == ["gemm", "ncclAllReduce", "gelu", "gemm"]
    assert heaviest(kernels, steps=1, top=2) == [(0.03, 1, "ncclAllReduce"), (0.02, 2, "gemm")]
    assert gaps(kernels) == [(2, "gemm", "gelu"), (10, "gelu", "gemm")]
