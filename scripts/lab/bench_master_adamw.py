"""The optimizer step of a DiT's parameters: FP32 AdamW against LiteGen's bf16 + FP32 masters.

What ``fp32_master_weights`` with the ``fused`` backend costs per step, measured alone on one
GPU (5 warm-up and 20 timed steps: ms per step, and the kernels' busy time per step from the
profiler, which leaves out host launch time), at DiT-XL/2's parameters (about 675M, 291
tensors; ``--depth`` and ``--hidden`` change the model):

* torch's fused AdamW over FP32 parameters, what hand-written mixed precision steps;
* LiteGen's one-pass master AdamW (:mod:`litegen.experimental.master_adamw`), one launch for all
  parameters, at several elements and warps per program.

    python3 -m scripts.lab.bench_master_adamw
    python3 -m scripts.lab.bench_master_adamw --depth 4
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from litegen.experimental import master_adamw
from litegen_zoo.dit_model import DiT, DiTConfig
from scripts.timing import kernel_ms, ms_per_call

SWEEP = ((2048, 4), (1024, 4), (1024, 2), (2048, 8), (4096, 8), (8192, 16))  # (elements, warps)


def timed(fn: Callable[[], object], device: torch.device) -> str:
    """``fn``'s wall ms per call (synced) and its kernels' busy ms per call (profiled)."""
    wall = ms_per_call(fn, device, calls=20, warmup=5)
    busy = kernel_ms(fn, calls=5)
    return f"{wall:8.3f} ms {busy:8.3f} ms busy"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1152)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (Triton)")
    device = torch.device("cuda")
    cfg = DiTConfig(hidden=args.hidden, depth=args.depth)
    fp32 = [q.detach().requires_grad_() for q in DiT(cfg).to(device).parameters()]
    for q in fp32:
        q.grad = torch.randn_like(q) * 1e-3
    torch_adamw = torch.optim.AdamW(fp32, lr=1e-4, weight_decay=0.01, fused=True)
    params = [q.detach().bfloat16() for q in fp32]
    columns = [
        params,
        [q.grad.bfloat16() for q in fp32],
        [q.detach().clone() for q in fp32],
        [torch.zeros_like(q) for q in fp32],
        [torch.zeros_like(q) for q in fp32],
        [torch.zeros((), device=device) for _ in fp32],
    ]
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    count = sum(q.numel() for q in params)
    print(f"{count / 1e6:.0f}M parameters in {len(params)} tensors, {torch.cuda.get_device_name()}")
    print(f"{timed(torch_adamw.step, device)}  torch fused AdamW, FP32 parameters")
    for block, warps in SWEEP:
        master_adamw._BLOCK, master_adamw._NUM_WARPS = block, warps
        ms = timed(lambda: master_adamw.adamw_master_step(*columns, **hyper), device)
        print(f"{ms}  master AdamW, one launch, {block} elements x {warps} warps")
    master_adamw._BLOCK, master_adamw._NUM_WARPS = SWEEP[0]  # LiteGen's choice


if __name__ == "__main__":
    main()
