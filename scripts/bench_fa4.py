"""FlashAttention 4 against cuDNN at the benchmark shapes, and the checks behind LiteGen's FA4 path.

Needs a Hopper/Blackwell GPU and the ``flash-attn-4`` package (``uv sync --all-packages --extra
flash-attn-4``). Sections, all by default:

- ``check``: ``F.scaled_dot_product_attention`` through LiteGen's ``math``, ``cudnn`` and
  ``flash_attn`` (FA4) contexts on packed-qkv views, head dims 72, 64, 128 and 40: largest error
  of the output and of dq, dk, dv against FP32 math, and fwd+bwd time; then a kernel profile
  of the FA4 path at workload A's shape.
- ``kernels``: FA4's own functions at head dim 72, with no LiteGen code in between, as released
  and with LiteGen's dq fix (``fa4._match_dq_accumulator_to_kernel``): dq, dk, dv against FP32
  math, unpadded and zero-padded to 96 (the ninth session's workaround), and their times.
- ``layouts``: cuDNN and FA4 through LiteGen at one shape, with dO first in the layout a DiT's
  backward makes ((batch, tokens, heads, dim) in memory), then contiguous, then the first again:
  gradient errors against FP32 math. torch 2.11's cuDNN backward reuses the plan of the first
  call for the second, and its gradients come out wrong.
- ``shapes``: forward and backward time, cuDNN against FA4 through LiteGen, at workloads C, A
  and B's shapes.
- ``configs``: at workload C's shape, kernel times from the profiler of FA4's backward under
  other configurations (with their gradient errors) and of its forward under other tiles; cuDNN's
  forward, whose log-sum-exp FA4's backward can take; and FA4's backward writing into one packed
  buffer against three tensors stacked afterwards (``litegen.kernels.packed_qkv``).
- ``forward``: the forward kernels of cuDNN and FA4 (with LiteGen's tiles) by sequence length at
  head dims 72, 128 and 64, and at B's shape, with the one LiteGen runs (``fa4._forward_on_cudnn``).

    python3 scripts/bench_fa4.py
    python3 scripts/bench_fa4.py --section kernels
    python3 scripts/bench_fa4.py --section configs
    python3 scripts/bench_fa4.py --section forward

The figures of 2026-11-30 are in docs/benchmarks.md (the FA4 sections of the ninth to twelfth
sessions; ``forward``: "cuDNN's forward for short sequences").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F
from dit_model import kernel_ms, median_cuda_ms

from litegen.kernels import fa4
from litegen.kernels.attention import activate_fa4, attention_context

DEVICE = torch.device("cuda")
SHAPES = {"C": (128, 16, 256, 72), "A": (8, 16, 4096, 72), "B": (2, 12, 17160, 128)}


def packed_qkv(batch: int, heads: int, tokens: int, head_dim: int) -> torch.Tensor:
    """(batch, tokens, 3, heads, dim), as a DiT's fused qkv projection makes it."""
    return torch.randn(batch, tokens, 3, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)


def max_error(got: torch.Tensor, want: torch.Tensor) -> str:
    return f"{(got.float() - want.float()).abs().max().item():.4f}"


def check() -> None:
    for shape in [(2, 16, 1024, 72), (2, 8, 512, 64), (2, 8, 512, 128), (2, 8, 512, 40)]:
        check_shape(shape)
    check_shape(SHAPES["A"])
    profile_a()


def check_shape(shape: tuple[int, int, int, int]) -> None:
    """Errors against FP32 math (shapes up to 1024 tokens) and fwd+bwd times, per context."""
    qkv = packed_qkv(*shape)
    dout = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    small = shape[2] <= 1024
    reference = attend(qkv.float(), dout.float(), "math") if small else None
    for backend in ("cudnn", "flash_attn"):
        out, grad = attend(qkv, dout, backend)
        line = f"{shape} {backend}: {median_cuda_ms(lambda b=backend: attend(qkv, dout, b)):.3f} ms"
        if reference is not None:
            errors = [max_error(grad[:, :, i], reference[1][:, :, i]) for i in range(3)]
            line += f", out error {max_error(out, reference[0])}, dq/dk/dv {' '.join(errors)}"
        print(line, flush=True)


def attend(qkv: torch.Tensor, dout: torch.Tensor, backend: str):
    """Output and packed-qkv gradient of one attention call in ``backend``'s context."""
    x = qkv.detach().requires_grad_()
    q, k, v = x.permute(2, 0, 3, 1, 4)
    with attention_context(backend, DEVICE):
        out = F.scaled_dot_product_attention(q, k, v)
        out.backward(dout)
    return out.detach(), x.grad


def profile_a() -> None:
    qkv = packed_qkv(*SHAPES["A"])
    dout = torch.randn(SHAPES["A"], device=DEVICE, dtype=torch.bfloat16)
    attend(qkv, dout, "flash_attn")
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            attend(qkv, dout, "flash_attn")
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="device_time_total", row_limit=14, max_name_column_width=70
    )
    print(table)


def kernels() -> None:
    kernels_at(2, 16, 1024)
    kernels_at(*SHAPES["A"][:3])


def kernels_at(batch: int, heads: int, tokens: int) -> None:
    """FA4's functions at head dim 72, unpadded and zero-padded, with and without the dq fix."""
    interface = fa4.interface()  # with LiteGen's dq fix
    released = interface._bwd_postprocess_convert.__wrapped__
    qkv = packed_qkv(batch, heads, tokens, 72)
    q, k, v = qkv.unbind(2)  # FA4's layout, (batch, tokens, heads, dim)
    dout = torch.randn(batch, tokens, heads, 72, device=DEVICE, dtype=torch.bfloat16)
    reference = None
    if tokens <= 1024:
        _, grad = attend(qkv.float(), dout.float().transpose(1, 2), "math")
        reference = grad.unbind(2)

    def run(padded: int) -> list[torch.Tensor]:
        scale = 72**-0.5
        qp, kp, vp, dp = (F.pad(t, (0, padded - 72)) if padded > 72 else t for t in (q, k, v, dout))
        out, lse, *_ = interface._flash_attn_fwd(qp, kp, vp, softmax_scale=scale, return_lse=True)
        grads = interface._flash_attn_bwd(qp, kp, vp, out, dp, lse, softmax_scale=scale)
        return [g[..., :72] for g in grads[:3]]

    for fixed in (False, True):
        label = "with the fix" if fixed else "as released"
        with (
            nullcontext()
            if fixed
            else mock.patch.object(interface, "_bwd_postprocess_convert", released)
        ):
            for padded in (72, 96):
                errors = ""
                if reference is not None:
                    got = run(padded)
                    errors = " ".join(max_error(g, r) for g, r in zip(got, reference, strict=True))
                    errors = f", dq/dk/dv error {errors}"
                ms = median_cuda_ms(lambda p=padded: run(p))
                print(f"{(batch, heads, tokens)} FA4 {label}, head dim {padded}: {ms:.3f} ms "
                      f"fwd+bwd{errors}", flush=True)  # fmt: skip
    ms = median_cuda_ms(lambda: attend(qkv, dout.transpose(1, 2), "cudnn"))
    print(f"{(batch, heads, tokens)} cuDNN: {ms:.3f} ms fwd+bwd", flush=True)


def layouts() -> None:
    shape = (2, 16, 1024, 72)
    qkv = packed_qkv(*shape)
    batch, heads, tokens, head_dim = shape
    dout = torch.randn(batch, tokens, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    order = {"(b, s, h, d)": dout.transpose(1, 2), "contiguous": dout.transpose(1, 2).contiguous()}
    reference = attend(qkv.float(), order["contiguous"].float(), "math")[1]
    for backend in ("cudnn", "flash_attn"):
        for layout in ("(b, s, h, d)", "contiguous", "(b, s, h, d)"):
            grad = attend(qkv, order[layout], backend)[1]
            errors = " ".join(max_error(grad[:, :, i], reference[:, :, i]) for i in range(3))
            print(f"{shape} {backend}, dO {layout}: dq/dk/dv error {errors}", flush=True)


def shapes() -> None:
    for name, shape in SHAPES.items():
        for backend in ("cudnn", "flash_attn"):
            forward_and_backward(name, shape, backend)


def forward_and_backward(name: str, shape: tuple[int, int, int, int], backend: str) -> None:
    x = packed_qkv(*shape).requires_grad_()
    dout = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    flops = 4 * shape[0] * shape[1] * shape[2] ** 2 * shape[3]  # forward; backward is 2.5x

    def forward() -> torch.Tensor:
        q, k, v = x.permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)

    with attention_context(backend, DEVICE):
        forward_ms = median_cuda_ms(forward)
        backward_ms = median_cuda_ms(lambda: forward().backward(dout)) - forward_ms
    print(
        f"{name} {backend}: forward {forward_ms:.3f} ms ({flops / forward_ms / 1e9:.0f} "
        f"TFLOP/s), backward {backward_ms:.3f} ms ({2.5 * flops / backward_ms / 1e9:.0f} TFLOP/s)",
        flush=True,
    )


def configs() -> None:
    """At C's shape: FA4's backward configurations and forward tiles, cuDNN's log-sum-exp, packed grads."""
    interface = fa4.interface()
    batch, heads, tokens, head_dim = SHAPES["C"]
    qkv = packed_qkv(batch, heads, tokens, head_dim)
    q, k, v = qkv.unbind(2)  # FA4's layout, (batch, tokens, heads, dim)
    dout = torch.randn_like(q)
    _, grad = attend(qkv[:8].float(), dout[:8].float().transpose(1, 2), "math")
    reference = grad.unbind(2)  # FP32 gradients of the first 8 batches
    out, lse, *_ = interface._flash_attn_fwd(q, k, v, return_lse=True, tile_mn=(128, 128))

    def backward(o=out, logsumexp=lse, grads=None) -> tuple[torch.Tensor, ...]:
        grads = grads or tuple(torch.empty_like(t) for t in (q, k, v))
        interface._flash_attn_bwd(
            q, k, v, o, dout, logsumexp, dq=grads[0], dk=grads[1], dv=grads[2]
        )
        return grads

    def errors(grads) -> str:
        return " / ".join(max_error(g[:8], r) for g, r in zip(grads, reference, strict=True))

    default = interface._tile_size_bwd_sm90(head_dim, head_dim, False, False)
    variants = {
        "FA4's own": {},
        "128 x 128 (FA4's for head dim <= 64)": dict(m_block_size=128, AtomLayoutMdQ=2, dQ_single_wg=False),
        "128 x 128, dQ in one warp group": dict(m_block_size=128),
        "64 x 64": dict(n_block_size=64),
        "128 x 64": dict(m_block_size=128, n_block_size=64),
        "64 x 128, dQ in both warp groups": dict(dQ_single_wg=False),
        "64 x 128, one PdS stage": dict(num_stages_PdS=1),
        "64 x 256": dict(n_block_size=256),
    }  # fmt: skip
    for label, change in variants.items():
        config = dataclasses.replace(default, **change)
        with mock.patch.object(interface, "_tile_size_bwd_sm90", return_value=config):
            grads = backward()
            print(f"C backward, {label}: {kernel_ms(backward):.3f} ms, dq/dk/dv error "
                  f"{errors(grads)}", flush=True)  # fmt: skip
    for tile, rs in [
        ((128, 128), None),
        ((128, 256), True),
        ((128, 192), False),
        ((64, 128), None),
    ]:

        def forward(tile=tile, rs=rs):
            return interface._flash_attn_fwd(
                q, k, v, return_lse=True, tile_mn=tile, mma_pv_is_rs=rs
            )

        print(f"C forward, tiles {tile}: {kernel_ms(forward):.3f} ms", flush=True)
    bhsd = [t.transpose(1, 2) for t in (q, k, v)]
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    cudnn_out, cudnn_lse = cudnn(*bhsd, None, True, 0.0, False, False)[:2]
    print(f"C forward, cuDNN: {kernel_ms(lambda: cudnn(*bhsd, None, True, 0.0, False, False)):.3f}"
          f" ms; log-sum-exp against FA4's {max_error(cudnn_lse.view_as(lse), lse)}; FA4's "
          f"backward from cuDNN's forward: dq/dk/dv error "
          f"{errors(backward(cudnn_out.transpose(1, 2), cudnn_lse.view_as(lse).contiguous()))}",
          flush=True)  # fmt: skip
    packed = torch.empty_like(qkv)
    print(f"C backward into one (b, s, 3, h, d) buffer: {kernel_ms(lambda: backward(grads=packed.unbind(2))):.3f} ms, "
          f"error {errors(backward(grads=packed.unbind(2)))}; into three tensors, then stacked: "
          f"{kernel_ms(lambda: torch.stack(backward(), 2)):.3f} ms", flush=True)  # fmt: skip


def forward() -> None:
    """cuDNN's forward against FA4's by sequence length, 32768 tokens a batch, and at B's shape."""
    interface = fa4.interface()
    arch = interface._get_device_arch()
    shapes = [
        (32768 // tokens, heads, tokens, head_dim)
        for heads, head_dim in ((16, 72), (12, 128), (16, 64))
        for tokens in (256, 512, 1024, 2048, 4096)
    ]

    def fa4_forward(q, k, v) -> tuple:  # FA4 as LiteGen calls it when cuDNN does not serve
        tile = fa4._forward_tile(q, k, False, arch)
        return interface._flash_attn_fwd(*fa4._bshd(q, k, v), return_lse=True, tile_mn=tile)

    for shape in [*shapes, SHAPES["B"]]:
        qkv = packed_qkv(*shape).permute(2, 0, 3, 1, 4)  # q, k, v: (batch, heads, tokens, dim)
        fa4_ms = kernel_ms(functools.partial(fa4_forward, *qkv))
        cudnn_ms = kernel_ms(functools.partial(fa4._cudnn_forward, *qkv, False, None))
        taken = "cuDNN" if fa4._forward_on_cudnn(qkv[0], qkv[1], False, arch) else "FA4"
        print(f"forward {shape}: FA4 {fa4_ms:.3f} ms, cuDNN {cudnn_ms:.3f} ms; LiteGen runs "
              f"{taken}'s", flush=True)  # fmt: skip


SECTIONS = {
    "check": check,
    "kernels": kernels,
    "layouts": layouts,
    "shapes": shapes,
    "configs": configs,
    "forward": forward,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=list(SECTIONS), action="append")
    args = parser.parse_args()
    if not activate_fa4(DEVICE):
        raise SystemExit("needs a Hopper/Blackwell GPU and the flash-attn-4 package")
    for name in args.section or SECTIONS:
        print(f"== {name}", flush=True)
        SECTIONS[name]()


if __name__ == "__main__":
    main()
