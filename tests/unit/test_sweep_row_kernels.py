"""scripts/lab/sweep_row_kernels.py: which files of an inductor cache it sweeps (timing: a GPU).

uv run pytest tests/unit/test_sweep_row_kernels.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")
from scripts.lab.sweep_row_kernels import row_kernels


def write(path: Path, *lines: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_only_standalone_norm_kernels_are_swept(tmp_path: Path):
    fixed = write(
        tmp_path / "ab" / "fixed.py",
        "def triton_unk_fused_add_native_layer_norm_1(in_ptr0, out_ptr0, xnumel, r0_numel):",
        "def get_args():",
    )
    autotuned = write(
        tmp_path / "cd" / "tuned.py",
        "def triton_per_fused_native_layer_norm_0(in_ptr0, xnumel, r0_numel, XBLOCK):",
        "def get_args():",
    )
    write(  # a graph module: it holds the kernel's source but runs the whole graph
        tmp_path / "ef" / "graph.py",
        "triton_unk_0 = async_compile.triton('k', '''",
        "def triton_unk_fused_native_layer_norm_0(in_ptr0, xnumel, r0_numel):",
        "def get_args():",
    )
    looped = write(  # two-pass: swept with an R0_BLOCK axis too
        tmp_path / "gh" / "looped.py",
        "def triton_red_fused_native_layer_norm_backward_0(in_ptr0, xnumel, r0_numel):",
        "def get_args():",
    )
    write(  # no benchmark harness (compiled without TORCHINDUCTOR_BENCHMARK_KERNEL=1)
        tmp_path / "ij" / "bare.py",
        "def triton_per_fused_native_layer_norm_2(in_ptr0, xnumel, r0_numel, XBLOCK):",
    )
    write(tmp_path / "kl" / "gelu.py", "def triton_per_fused_gelu_3(in_ptr0):", "def get_args():")
    assert row_kernels(tmp_path) == [
        (fixed, "triton_unk_fused_add_native_layer_norm_1"),
        (autotuned, "triton_per_fused_native_layer_norm_0"),
        (looped, "triton_red_fused_native_layer_norm_backward_0"),
    ]
