"""scripts/trace_kernels.py on a hand-made trace: heaviest kernels and the gaps between them."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from trace_kernels import gaps, heaviest, host_calls, load_kernels


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
    assert gaps(kernels) == [(2, "gemm", "gelu", 10), (10, "gelu", "gemm", 15)]


def test_host_calls_name_what_overlaps_a_gap_most():
    host = [
        {"name": "cudaLaunchKernel", "ts": 0, "dur": 2},  # before the gap
        {"name": "cudaEventSynchronize", "ts": 14, "dur": 8},  # 6 us inside
        {"name": "aten::item", "ts": 18, "dur": 1},
        {"name": "aten::item", "ts": 21, "dur": 10},  # 4 us inside: 5 in all
        {"name": "cudaLaunchKernel", "ts": 24, "dur": 1},
    ]
    # The gap of the trace above: 10 us from 15.
    assert host_calls(host, 15, 10, top=2) == "cudaEventSynchronize 0.01 ms, aten::item 0.01 ms"
    assert host_calls(host, 15, 10, top=3).endswith("cudaLaunchKernel 0.00 ms")
