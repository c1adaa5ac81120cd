"""Could a Triton attention kernel beat cuDNN at head dim 72? A measurement, not a LiteGen kernel.

Workloads A and C of issue 8 (docs/benchmarks.md) use 16 heads of dim 72, which cuDNN runs in
tiles of 128. This script holds a FlashAttention-2-style kernel pair (forward; backward as a
dQ pass then a dK/dV pass) that splits the head dim into 64 + 16 columns instead, so it pads
72 to 80 rather than 128. It times them against cuDNN's forward and backward ops at C's and A's
shapes (bf16), with a small sweep of block sizes, and checks every result against cuDNN's:

    python3 scripts/bench_attention_triton.py                  # on a GPU: the table
    TRITON_INTERPRET=1 python3 scripts/bench_attention_triton.py --check   # CPU: correctness

The 2026-11-30 result: cuDNN was 1.7-1.9x faster at both shapes, so LiteGen keeps cuDNN
(docs/benchmarks.md, "A Triton attention kernel for head dim 72").
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from dit_model import median_cuda_ms

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # kernels may read only constexpr globals
# (rows per program, keys per iteration, warps, stages): the forward and dQ kernels iterate
# over keys for a block of query rows; the dK/dV kernel iterates over queries for a key block.
FORWARD_CONFIGS = [
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 4),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (128, 128, 4, 2),
]
DQ_CONFIGS = [(128, 64, 8, 2), (128, 64, 4, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2)]
DKDV_CONFIGS = [(64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)]
SHAPES = {"C": (128, 16, 256, 72), "A": (8, 16, 4096, 72)}  # batch, heads, tokens, head dim


@triton.jit
def _rows(base, offs, stride, offs_a, offs_b, mask_b):
    """Rows ``offs`` of a (tokens, head dim) matrix as its two column blocks."""
    ptr = base + offs[:, None] * stride
    return (
        tl.load(ptr + offs_a[None, :]),
        tl.load(ptr + offs_b[None, :], mask=mask_b[None, :], other=0.0),
    )


@triton.jit
def _cols(base, offs, stride, offs_a, offs_b, mask_b):
    """The same, transposed: (head dim, tokens)."""
    ptr = base + offs[None, :] * stride
    return (
        tl.load(ptr + offs_a[:, None]),
        tl.load(ptr + offs_b[:, None], mask=mask_b[:, None], other=0.0),
    )


@triton.jit
def _store_rows(base, offs, stride, offs_a, offs_b, mask_b, a, b):
    ptr = base + offs[:, None] * stride
    tl.store(ptr + offs_a[None, :], a.to(base.dtype.element_ty))
    tl.store(ptr + offs_b[None, :], b.to(base.dtype.element_ty), mask=mask_b[None, :])


@triton.jit
def _head(ptr, b, h, stride_b, stride_h):
    """Where (batch b, head h) of a (batch, heads, tokens, dim) tensor starts."""
    return ptr + b.to(tl.int64) * stride_b + h * stride_h


@triton.jit
def _program(H, D: tl.constexpr, DB: tl.constexpr, BLOCK: tl.constexpr):
    """This program's (batch x head) index, batch, head, token block, and head-dim columns."""
    bh = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_a = tl.arange(0, 64)
    offs_b = 64 + tl.arange(0, DB)
    return bh, bh // H, bh % H, offs, offs_a, offs_b, offs_b < D


@triton.jit
def _attention_fwd(
    Q, K, V, Out, LSE,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    H, N, qk_scale,
    D: tl.constexpr, DB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    bh, b, h, offs_m, offs_a, offs_b, mask_b = _program(H, D, DB, BM)
    q_a, q_b = _rows(_head(Q, b, h, sqb, sqh), offs_m, sqn, offs_a, offs_b, mask_b)
    k_base = _head(K, b, h, skb, skh)
    v_base = _head(V, b, h, svb, svh)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc_a = tl.zeros([BM, 64], tl.float32)
    acc_b = tl.zeros([BM, DB], tl.float32)
    for start in range(0, N, BN):
        offs_n = start + tl.arange(0, BN)
        kt_a, kt_b = _cols(k_base, offs_n, skn, offs_a, offs_b, mask_b)
        s = tl.dot(q_b, kt_b, tl.dot(q_a, kt_a)) * qk_scale  # log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_a, v_b = _rows(v_base, offs_n, svn, offs_a, offs_b, mask_b)
        p = p.to(v_a.dtype)
        acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
        acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
        m_i = m_new
    o_base = _head(Out, b, h, sob, soh)
    _store_rows(
        o_base, offs_m, son, offs_a, offs_b, mask_b, acc_a / l_i[:, None], acc_b / l_i[:, None]
    )
    # The natural-log log-sum-exp of the scaled scores, as cuDNN keeps it.
    tl.store(LSE + bh.to(tl.int64) * N + offs_m, (m_i + tl.math.log2(l_i)) / _LOG2E)


@triton.jit
def _attention_bwd_dq(
    Q, K, V, Out, DO, LSE, DELTA, DQ,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sgb, sgh, sgn,
    H, N, qk_scale, sm_scale,
    D: tl.constexpr, DB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """dQ for a block of query rows; also stores ``delta = rowsum(dO * O)`` for the dK/dV pass.

    ``Out`` and ``DO`` share the ``so*`` strides; ``sg*`` are ``DQ``'s.
    """
    bh, b, h, offs_m, offs_a, offs_b, mask_b = _program(H, D, DB, BM)
    q_a, q_b = _rows(_head(Q, b, h, sqb, sqh), offs_m, sqn, offs_a, offs_b, mask_b)
    do_a, do_b = _rows(_head(DO, b, h, sob, soh), offs_m, son, offs_a, offs_b, mask_b)
    o_a, o_b = _rows(_head(Out, b, h, sob, soh), offs_m, son, offs_a, offs_b, mask_b)
    delta = tl.sum(o_a.to(tl.float32) * do_a.to(tl.float32), 1)
    delta += tl.sum(o_b.to(tl.float32) * do_b.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * N + offs_m, delta)
    lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m) * _LOG2E
    k_base = _head(K, b, h, skb, skh)
    v_base = _head(V, b, h, svb, svh)
    dq_a = tl.zeros([BM, 64], tl.float32)
    dq_b = tl.zeros([BM, DB], tl.float32)
    for start in range(0, N, BN):
        offs_n = start + tl.arange(0, BN)
        kt_a, kt_b = _cols(k_base, offs_n, skn, offs_a, offs_b, mask_b)
        p = tl.math.exp2(tl.dot(q_b, kt_b, tl.dot(q_a, kt_a)) * qk_scale - lse[:, None])
        vt_a, vt_b = _cols(v_base, offs_n, svn, offs_a, offs_b, mask_b)
        dp = tl.dot(do_b, vt_b, tl.dot(do_a, vt_a))
        ds = (p * (dp - delta[:, None])).to(q_a.dtype)
        dq_a = tl.dot(ds, tl.trans(kt_a), dq_a)
        dq_b = tl.dot(ds, tl.trans(kt_b), dq_b)
    dq_base = _head(DQ, b, h, sgb, sgh)
    _store_rows(dq_base, offs_m, sgn, offs_a, offs_b, mask_b, dq_a * sm_scale, dq_b * sm_scale)


@triton.jit
def _attention_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sgb, sgh, sgn,
    H, N, qk_scale, sm_scale,
    D: tl.constexpr, DB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """dK and dV for a block of keys, iterating over the queries (scores kept transposed).

    ``so*`` are ``DO``'s strides; ``sg*`` are those of ``DK`` and ``DV``.
    """
    bh, b, h, offs_n, offs_a, offs_b, mask_b = _program(H, D, DB, BN)
    k_a, k_b = _rows(_head(K, b, h, skb, skh), offs_n, skn, offs_a, offs_b, mask_b)
    v_a, v_b = _rows(_head(V, b, h, svb, svh), offs_n, svn, offs_a, offs_b, mask_b)
    q_base = _head(Q, b, h, sqb, sqh)
    do_base = _head(DO, b, h, sob, soh)
    dk_a = tl.zeros([BN, 64], tl.float32)
    dk_b = tl.zeros([BN, DB], tl.float32)
    dv_a = tl.zeros([BN, 64], tl.float32)
    dv_b = tl.zeros([BN, DB], tl.float32)
    for start in range(0, N, BM):
        offs_m = start + tl.arange(0, BM)
        qt_a, qt_b = _cols(q_base, offs_m, sqn, offs_a, offs_b, mask_b)
        lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m) * _LOG2E
        pt = tl.math.exp2(tl.dot(k_b, qt_b, tl.dot(k_a, qt_a)) * qk_scale - lse[None, :])
        do_a, do_b = _rows(do_base, offs_m, son, offs_a, offs_b, mask_b)
        pt16 = pt.to(do_a.dtype)
        dv_a = tl.dot(pt16, do_a, dv_a)
        dv_b = tl.dot(pt16, do_b, dv_b)
        dpt = tl.dot(v_b, tl.trans(do_b), tl.dot(v_a, tl.trans(do_a)))
        delta = tl.load(DELTA + bh.to(tl.int64) * N + offs_m)
        dst = (pt * (dpt - delta[None, :])).to(qt_a.dtype)
        dk_a = tl.dot(dst, tl.trans(qt_a), dk_a)
        dk_b = tl.dot(dst, tl.trans(qt_b), dk_b)
    dk_base = _head(DK, b, h, sgb, sgh)
    _store_rows(dk_base, offs_n, sgn, offs_a, offs_b, mask_b, dk_a * sm_scale, dk_b * sm_scale)
    _store_rows(_head(DV, b, h, sgb, sgh), offs_n, sgn, offs_a, offs_b, mask_b, dv_a, dv_b)


def _strides(*tensors: torch.Tensor) -> list[int]:
    """Batch, head and token strides of (batch, heads, tokens, dim) tensors, in order."""
    return [s for t in tensors for s in t.stride()[:3]]


def _like_sdpa_output(q: torch.Tensor) -> torch.Tensor:
    b, h, n, d = q.shape
    return torch.empty(b, n, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)


def _launch_args(q: torch.Tensor, config: tuple[int, int, int, int], keys_per_program: bool):
    b, h, n, d = q.shape
    rows, keys, warps, stages = config
    if d <= 64 or d > 128 or n % rows or n % keys:
        raise ValueError(f"shape {tuple(q.shape)} does not fit config {config}")
    grid = (n // (keys if keys_per_program else rows), b * h)
    meta = dict(D=d, DB=max(16, triton.next_power_of_2(d - 64)), BM=rows, BN=keys)
    return grid, meta | dict(num_warps=warps, num_stages=stages)


def attention_forward(q, k, v, config=(128, 64, 4, 3)):
    """``(out, lse)`` of softmax(q k^T / sqrt(d)) v for (batch, heads, tokens, 64 < d <= 128)."""
    b, h, n, d = q.shape
    out = _like_sdpa_output(q)
    lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    grid, meta = _launch_args(q, config, keys_per_program=False)
    strides = _strides(q, k, v, out)
    _attention_fwd[grid](q, k, v, out, lse, *strides, h, n, LOG2E / math.sqrt(d), **meta)
    return out, lse


def attention_backward(
    grad, q, k, v, out, lse, dq_config=(128, 64, 4, 2), dkdv_config=(64, 64, 4, 3)
):
    """``(dq, dk, dv)`` of :func:`attention_forward`; ``grad`` is laid out like ``out``."""
    _, h, n, d = q.shape
    grad = (
        grad if grad.stride() == out.stride() else grad.clone(memory_format=torch.preserve_format)
    )
    assert grad.stride() == out.stride(), "grad must share out's layout"
    dq, dk, dv = (_like_sdpa_output(t) for t in (q, k, v))
    delta = torch.empty_like(lse)
    scales = (LOG2E / math.sqrt(d), 1 / math.sqrt(d))
    grid, meta = _launch_args(q, dq_config, keys_per_program=False)
    strides = _strides(q, k, v, out, dq)
    _attention_bwd_dq[grid](q, k, v, out, grad, lse, delta, dq, *strides, h, n, *scales, **meta)
    grid, meta = _launch_args(q, dkdv_config, keys_per_program=True)
    strides = _strides(q, k, v, grad, dk)
    _attention_bwd_dkdv[grid](q, k, v, grad, lse, delta, dk, dv, *strides, h, n, *scales, **meta)
    return dq, dk, dv


def sdpa_layout_qkv(b: int, h: int, n: int, d: int, device: str, dtype: torch.dtype):
    """q, k, v as a DiT block makes them: views into one (batch, tokens, 3, heads, dim) tensor."""
    return torch.randn(b, n, 3, h, d, device=device, dtype=dtype).permute(2, 0, 3, 1, 4).unbind(0)


def check() -> None:
    """Forward and backward against torch's SDPA in fp32 (runs on CPU under TRITON_INTERPRET=1)."""
    torch.manual_seed(0)
    q, k, v = (
        t.clone().requires_grad_() for t in sdpa_layout_qkv(2, 2, 64, 72, "cpu", torch.float32)
    )
    expected = F.scaled_dot_product_attention(q, k, v)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    with torch.no_grad():
        out, lse = attention_forward(q, k, v, config=(32, 16, 4, 2))
        scores = q @ k.transpose(-1, -2) / math.sqrt(72)
        grads = attention_backward(grad, q, k, v, out, lse, (32, 16, 4, 2), (16, 32, 4, 2))
    errors = {
        "out": (out - expected).abs().max().item(),
        "lse": (lse - scores.logsumexp(-1)).abs().max().item(),
        **{
            f"d{n}": (g - t.grad).abs().max().item()
            for n, g, t in zip("qkv", grads, (q, k, v), strict=True)
        },
    }
    print("max abs errors:", {name: f"{e:.1e}" for name, e in errors.items()})
    if not max(errors.values()) <= 1e-4:  # NaN fails too
        raise SystemExit(f"mismatch against torch's SDPA: {errors}")


def _max_error(got, expected) -> float:
    return max(
        (a.float() - b.float()).abs().max().item() for a, b in zip(got, expected, strict=True)
    )


def bench(workload: str) -> dict[str, float]:
    """cuDNN's and the Triton kernels' times (ms) at one workload's shape; prints the sweep."""
    b, h, n, d = SHAPES[workload]
    torch.manual_seed(0)
    q, k, v = sdpa_layout_qkv(b, h, n, d, "cuda", torch.bfloat16)
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    cudnn_bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    res = cudnn(q, k, v, None, True)
    out, lse = res[0], res[1]
    grad = torch.randn_like(out)
    rest = (res[6], res[7], None, res[2], res[3], n, n, 0.0, False)
    expected = cudnn_bwd(grad, q, k, v, out, lse, *rest)
    flops = 4 * b * h * n * n * d  # forward; the backward is 2.5x

    def tflops(ms: float, factor: float = 1.0) -> str:
        return f"{ms:.3f} ms ({factor * flops / ms / 1e9:.0f} TFLOP/s)"

    times = {
        "cudnn forward": median_cuda_ms(lambda: cudnn(q, k, v, None, True)),
        "cudnn backward": median_cuda_ms(lambda: cudnn_bwd(grad, q, k, v, out, lse, *rest)),
    }
    print(
        f"== {workload} {SHAPES[workload]}: cudnn forward {tflops(times['cudnn forward'])}, "
        f"backward {tflops(times['cudnn backward'], 2.5)}"
    )
    forward = {}
    for config in FORWARD_CONFIGS:
        forward[config] = median_cuda_ms(lambda c=config: attention_forward(q, k, v, c))
        got = attention_forward(q, k, v, config)
        print(
            f"triton forward {config}: {tflops(forward[config])}, max error against cuDNN: "
            f"out {_max_error(got[:1], [out]):.1e}, lse {_max_error(got[1:], [lse.view(b, h, n)]):.1e}"
        )
    best = min(forward, key=forward.get)
    out_t, lse_t = attention_forward(q, k, v, best)
    backward = {}
    for dq_config in DQ_CONFIGS:
        for dkdv_config in DKDV_CONFIGS:
            args = (grad, q, k, v, out_t, lse_t, dq_config, dkdv_config)
            backward[dq_config, dkdv_config] = median_cuda_ms(lambda a=args: attention_backward(*a))
    best_bwd = min(backward, key=backward.get)
    got = attention_backward(grad, q, k, v, out_t, lse_t, *best_bwd)
    times["triton forward"], times["triton backward"] = forward[best], backward[best_bwd]
    print(
        f"triton: forward {tflops(forward[best])} with {best}; backward "
        f"{tflops(backward[best_bwd], 2.5)} with dq {best_bwd[0]}, dk/dv {best_bwd[1]}; "
        f"max gradient error against cuDNN {_max_error(got, expected):.1e} "
        f"(largest gradient {max(g.abs().max().item() for g in expected):.1e})"
    )
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="correctness only (CPU: interpreter)")
    parser.add_argument("--workloads", default="CA", help="letters of SHAPES to time")
    if parser.parse_args().check:
        return check()
    rows = {w: bench(w) for w in parser.parse_args().workloads}
    print("\nworkload  cudnn fwd  triton fwd  cudnn bwd  triton bwd  (ms)")
    for w, t in rows.items():
        print(
            f"{w:8}  {t['cudnn forward']:9.3f}  {t['triton forward']:10.3f}  "
            f"{t['cudnn backward']:9.3f}  {t['triton backward']:10.3f}"
        )


if __name__ == "__main__":
    main()
