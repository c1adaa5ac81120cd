"""One compiled Wan 2.1 block, forward and backward, with and without the fused self-attention.

What ``optimization.experimental.fused_wan_attention`` changes in a step, measured on one
block of Wan 2.1 1.3B (bf16 parameters under bf16 autocast, as the ``bf16-mixed`` preset runs
it; each variant compiled as LiteGen compiles a block, with coordinate-descent tuning): ms per
forward and backward (median of CUDA-event timings), for diffusers' processor; the fused
processor with the norms and rotary embedding left to inductor (what the single QKV GEMM
gains); and the fused processor as LiteGen runs it. Each variant's parameter gradients are
compared with those of diffusers' processor (the largest relative difference over the block's
parameters; both sides round to bf16 in different places, so this is not zero).

    python3 -m scripts.lab.bench_wan_attention                    # 17,160 tokens, as bench_launch
    python3 -m scripts.lab.bench_wan_attention --tokens 32760 --calls 10
"""

from __future__ import annotations

import argparse
import copy
from unittest import mock

import torch

from litegen.compile import correct_gradient_options
from litegen.experimental import qk_norm_rope, wan_attention
from litegen_zoo.real_models import REAL_MODELS
from scripts.timing import median_cuda_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=17160)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--no-tuning", action="store_true", help="without coordinate-descent tuning")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    options = correct_gradient_options() | {"coordinate_descent_tuning": not args.no_tuning}
    time_block(args.tokens, args.text_tokens, args.calls, options)


def time_block(tokens: int, text_tokens: int, calls: int, options: dict) -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    wan = REAL_MODELS["wan"].build("reference", num_layers=1)
    config = wan.config
    block = wan.blocks[0].to(device, torch.bfloat16)
    dim, heads = config.num_attention_heads * config.attention_head_dim, config.num_attention_heads
    hidden = torch.randn(1, tokens, dim, device=device, dtype=torch.bfloat16)
    text = torch.randn(1, text_tokens, dim, device=device, dtype=torch.bfloat16)
    temb = torch.randn(1, 6, dim, device=device, dtype=torch.bfloat16)
    angles = torch.rand(1, tokens, 1, dim // heads // 2, device=device) * 6.28
    angles = angles.repeat_interleave(2, -1)
    rotary = (angles.cos(), angles.sin())
    grad_out = torch.randn_like(hidden)

    def variant(fused: bool) -> torch.nn.Module:
        copied = copy.deepcopy(block)
        if fused:
            wan_attention.apply_fused_wan_attention(copied)
        copied.forward = torch.compile(copied.forward, options=options)
        return copied

    def step(module: torch.nn.Module) -> None:
        with torch.autocast("cuda", torch.bfloat16):
            out = module(hidden, text, temb, rotary)
        out.backward(grad_out)

    rows = []
    grads = {}
    for name, fused, patch in (
        ("diffusers' processor", False, None),
        ("one QKV GEMM, norms and rotary by inductor", True, qk_norm_rope.reference),
        ("one QKV GEMM, fused norms and rotary (LiteGen)", True, None),
    ):
        module = variant(fused)
        with mock.patch.object(wan_attention, "qk_norm_rope", patch or wan_attention.qk_norm_rope):
            step(module)
            grads[name] = [p.grad.float().clone() for p in module.parameters()]
            module.zero_grad(set_to_none=True)
            rows.append((name, median_cuda_ms(lambda m=module: step(m), calls=calls)))
    print(f"Wan 2.1 1.3B block, {tokens} tokens, bf16, compiled; ms per forward+backward")
    base = rows[0][1]
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {base / ms:.3f}x |")
    reference = grads[rows[0][0]]
    for name, _ in rows[1:]:
        worst = max(
            ((g - r).norm() / r.norm().clamp_min(1e-12)).item()
            for g, r in zip(grads[name], reference, strict=True)
        )
        print(f"largest relative gradient difference against diffusers', {name}: {worst:.2e}")


if __name__ == "__main__":
    main()
