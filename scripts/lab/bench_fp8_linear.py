"""One Linear layer's forward and backward in bf16 against torchao's FP8 training, per shape.

Where FP8 linear training (``optimization.precision.fp8_linear``) can pay off, measured alone:
each row is one compiled ``nn.Linear`` with fp32 weights under bf16 autocast, as a
``bf16-mixed`` step runs it, then the same layer converted as ``fp8_linear`` converts it
(``litegen.precision.fp8_training``: torchao's float8 training) with the ``tensorwise`` and the ``rowwise``
recipe (the FP8 casts, their scales and the three FP8 GEMMs of forward and backward). Median
ms per call over 20 calls after warm-up, one machine start. The shapes are the Linear layers
of DiT-XL/2 at batch 128, Wan 2.1 1.3B and Wan 2.1 14B (tokens x in -> out):

    python3 -m scripts.lab.bench_fp8_linear
    python3 -m scripts.lab.bench_fp8_linear --shapes 32768x1152x4608,75600x5120x13824
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from litegen.precision.fp8_training import apply_fp8_training, fp8_unavailable
from scripts.timing import median_cuda_ms, release

SHAPES = {
    "dit-xl qkv/out": (32768, 1152, 1152),
    "dit-xl mlp up": (32768, 1152, 4608),
    "dit-xl mlp down": (32768, 4608, 1152),
    "dit-xl adaLN": (128, 1152, 6912),
    "wan-1.3b ffn up (4,680 tok)": (4680, 1536, 8960),
    "wan-1.3b ffn up (32,760 tok)": (32760, 1536, 8960),
    "wan-14b attn (75,600 tok)": (75600, 5120, 5120),
    "wan-14b ffn up (75,600 tok)": (75600, 5120, 13824),
}


def layer_ms(tokens: int, d_in: int, d_out: int, recipe: str | None) -> float:
    """Median ms of one compiled forward and backward of the layer (``recipe`` None: bf16)."""
    device = torch.device("cuda")
    layer = nn.Sequential(nn.Linear(d_in, d_out)).to(device)
    if recipe is not None and apply_fp8_training(layer, recipe, device) != 1:
        raise SystemExit(f"FP8 training cannot run here: {fp8_unavailable(device)}")
    step = torch.compile(lambda x, g: layer(x).backward(g))
    x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)

    def call() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step(x, grad)

    ms = median_cuda_ms(call, calls=20, warmup=3)
    release(device)
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="tokens x in x out, comma-separated")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer)")
    shapes = (
        {s: tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")}
        if args.shapes
        else SHAPES
    )
    print(
        f"{'layer':32} {'tokens x in x out':>20} {'bf16 ms':>8} {'tensorwise':>11} {'rowwise':>8}"
    )
    for name, (tokens, d_in, d_out) in shapes.items():
        bf16 = layer_ms(tokens, d_in, d_out, None)
        ratios = [bf16 / layer_ms(tokens, d_in, d_out, r) for r in ("tensorwise", "rowwise")]
        print(
            f"{name:32} {f'{tokens}x{d_in}x{d_out}':>20} {bf16:8.3f} "
            f"{ratios[0]:10.2f}x {ratios[1]:7.2f}x"
        )


if __name__ == "__main__":
    main()
