"""The fused GELU MLP's two GEMMs against torch's kernels, at a DiT's MLP shape, on one GPU.

What ``optimization.experimental.fused_gelu_mlp`` changes in a step, measured alone (bf16, 3
warm-up and 20 timed calls, ms per call): the first linear layer plus GELU (forward), and the
second layer's input gradient plus the GELU gradient and the first layer's bias gradient
(backward). The cuBLASLt rows run the fastest of its candidate algorithms, as LiteGen does; two
rows time the bias sums against ones-vector GEMVs.
Defaults are workloads A and C's MLP (32768 tokens, 1152 -> 4608 -> 1152):

    python3 -m scripts.lab.bench_gelu_mlp
    python3 -m scripts.lab.bench_gelu_mlp --tokens 8192 --hidden 1536
    python3 -m scripts.lab.bench_gelu_mlp --energy   # and each row's energy at the power limit
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from litegen.experimental.cublaslt import dgelu, gelu_aux_bias
from scripts.lab.gpu_power import PowerMeter, sustained
from scripts.timing import ms_per_call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=1152)
    p.add_argument("--mlp-ratio", type=int, default=4)
    p.add_argument(
        "--energy",
        action="store_true",
        help="also each row's energy per call under sustained load (gpu_power.py), where the "
        "GPU runs at its power limit as in training",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (cuBLASLt)")

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)

    device = torch.device("cuda")
    n, d, inner = args.tokens, args.hidden, args.hidden * args.mlp_ratio
    x, w1, b1, w2 = randn(n, d), randn(inner, d, scale=0.03), randn(inner), randn(d, inner)
    grad_y, pre = randn(n, d), randn(n, inner)
    ones = torch.ones(n, device=device, dtype=torch.bfloat16)

    def torch_backward() -> None:
        grad_pre = torch.ops.aten.gelu_backward(grad_y @ w2, pre, approximate="tanh")
        grad_pre.sum(0)

    rows = {
        "forward, torch: addmm, then GELU": lambda: F.gelu(F.linear(x, w1, b1), approximate="tanh"),
        "forward, the addmm alone": lambda: F.linear(x, w1, b1),
        "forward, fused: GELU_AUX_BIAS": lambda: gelu_aux_bias(x, w1, b1),
        "backward, torch: mm, GELU gradient, bias sum": torch_backward,
        "backward, the mm alone": lambda: grad_y @ w2,
        "backward, fused: DGELU, bias sum": lambda: dgelu(grad_y, w2, pre).sum(0),
        "bias gradients, torch: 2 sums": lambda: (pre.sum(0), grad_y.sum(0)),
        "bias gradients, as 2 GEMVs with a ones vector": lambda: (ones @ pre, ones @ grad_y),
    }
    if gelu_aux_bias(x, w1, b1) is None or dgelu(grad_y, w2, pre) is None:
        p.error("cuBLASLt offers no GELU epilogue algorithm for this shape on this GPU")
    print(f"{n} tokens, {d} -> {inner} -> {d}, bf16, {torch.cuda.get_device_name()}")
    for name, fn in rows.items():
        print(f"{ms_per_call(fn, device, calls=20):8.3f} ms  {name}")
    meter = PowerMeter.for_device(device) if args.energy else None
    if args.energy and meter is None:
        print("--energy: NVML reads no energy on this GPU; skipped")
    if meter is not None:
        print("under sustained load (2 s each): ms and mJ a call, watts, SM clock")
        for name, fn in rows.items():
            r = sustained(fn, meter)
            power = f"{r['mj']:6.0f} mJ {r['watts']:4.0f} W {r['sm_mhz']:5.0f} MHz"
            print(f"{r['ms']:8.3f} ms {power}  {name}")


if __name__ == "__main__":
    main()
