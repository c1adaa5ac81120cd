"""scripts/lab/trace_kernels.py on a hand-made trace: heaviest kernels and the gaps between them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from scripts.lab.trace_kernels import gaps, heaviest, host_calls, kernel_category, load_kernels


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


def test_kernel_categories_of_a_compiled_dit_step():
    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
        "void cudnn::fusion::compute_dot_do_o<true>(void const*, void const*)": "attention",
        "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)": "attention",
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64_aux_bf16_dgelu": "gemm",
        "ncclDevKernel_AllGather_RING_LL": "communication",
        "_adamw_master_kernel": "optimizer",
        "triton_per_fused__to_copy_add_mul_native_layer_norm_split_unsqueeze_1": "elementwise/other",
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16>>": (
            "elementwise/other"
        ),
    }
    assert {name: kernel_category(name) for name in names} == names
