"""Compiled blocks' gradients against eager ones on a real diffusers model.

Builds ``REAL_MODELS[--model]`` (random weights, the published config or ``--tiny``) and one
synthetic batch, then trains ``--steps`` AdamW steps on that batch three times from the same
weights: eager; every repeated block compiled by hand (``block.forward =
torch.compile(block.forward)``, no LiteGen code); and through LiteGen's ``compile_blocks``. It
prints each side's loss and gradient norm per step and the parameters whose first-step gradients
differ most from eager's, and exits 1 when a compiled side's first-step gradients differ from
eager's by more than ``--tolerance`` (relative, all parameters together). The two compiled sides
tell a torch problem (both differ) from a LiteGen one (only LiteGen's differs). The hand side uses
``torch.compile``'s defaults, so it shows the torch bugs that LiteGen's compile settings avoid
(on CUDA with torch 2.10 or later, inductor's mix-order reduction; ``litegen/compile.py``).

    python3 -m scripts.lab.compile_grad_check --model wan --frames 5                    # GPU, bf16
    python3 -m scripts.lab.compile_grad_check --model wan --frames 5 --sides hand --part attn1
    uv run --locked python -m scripts.lab.compile_grad_check --device cpu --tiny --model wan  # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

SIDES = ("eager", "hand", "litegen")


def train(args: argparse.Namespace, side: str) -> dict[str, Any]:
    """``--steps`` steps of one side: losses, gradient norms and the first step's gradients."""
    from litegen.compile import compile_blocks
    from litegen.model_parts.blocks import repeated_blocks
    from litegen.utils.config import CompileConfig
    from litegen_zoo.real_models import REAL_MODELS, LatentShape

    spec = REAL_MODELS[args.model]
    size = "tiny" if args.tiny else "reference"
    device = torch.device(args.device)
    with device:  # the same seed builds the same weights for every side
        model = spec.build(size, seed=0)
    shape = spec.shape(size)
    if args.frames is not None:
        shape = LatentShape(shape.height, shape.width, args.frames, shape.text_tokens)
    batch = {k: v.to(device) for k, v in spec.batch(size, 1, seed=0, shape=shape).items()}
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    if side == "hand":
        for path in repeated_blocks(model):
            target = model.get_submodule(path).get_submodule(args.part)
            target.forward = torch.compile(target.forward, backend=backend)
    elif side == "litegen":
        compile_blocks(
            model, CompileConfig(enabled=True), backend=None if backend == "inductor" else backend
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if device.type == "cuda" and not args.fp32
        else nullcontext()
    )
    out: dict[str, Any] = {"loss": [], "grad_norm": []}
    for step in range(args.steps):
        with autocast:
            loss = spec.loss(model, batch)
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        out["loss"].append(loss.item())
        out["grad_norm"].append(torch.stack([g.norm() for g in grads.values()]).norm().item())
        if step == 0:
            out["grads"] = {n: g.cpu().clone() for n, g in grads.items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def difference(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """``|grads - reference| / |reference|`` over all parameters together."""
    num = sum((grads[n] - g).square().sum() for n, g in reference.items())
    den = sum(g.square().sum() for g in reference.values())
    return float((num / den).sqrt())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wan")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="the tiny config (smoke run)")
    parser.add_argument("--frames", type=int, help="latent frames (video models)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--backend", help="torch.compile backend (default: inductor; cpu: aot_eager)"
    )
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument(
        "--sides", default=",".join(SIDES), help="comma-separated, from eager,hand,litegen"
    )
    parser.add_argument(
        "--part",
        default="",
        help="compile only this submodule of each block on the hand side (e.g. attn1, ffn)",
    )
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast on the GPU")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    runs = {}
    sides = ["eager", *(s for s in args.sides.split(",") if s != "eager")]
    if unknown := set(sides) - set(SIDES):
        parser.error(f"--sides: unknown {sorted(unknown)}; choose from {','.join(SIDES)}")
    for side in sides:
        runs[side] = train(args, side)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    reference = runs["eager"]["grads"]
    failed = False
    report: dict[str, Any] = {"torch": torch.__version__, "model": args.model, "sides": {}}
    print(f"{'side':8} {'grad diff':>10}  loss / gradient norm per step")
    for side, run in runs.items():
        diff = difference(run["grads"], reference)
        failed |= side != "eager" and diff > args.tolerance
        pairs = zip(run["loss"], run["grad_norm"], strict=True)
        steps = "  ".join(f"{loss:.4f}/{norm:.3g}" for loss, norm in pairs)
        print(f"{side:8} {diff:10.3g}  {steps}")
        worst = sorted(reference, key=lambda n: -float((run["grads"][n] - reference[n]).norm()))[:5]
        report["sides"][side] = {
            "grad_diff": diff,
            "loss": run["loss"],
            "grad_norm": run["grad_norm"],
            "worst": {n: float((run["grads"][n] - reference[n]).norm()) for n in worst},
        }
        if side != "eager":
            print("         largest:", ", ".join(worst[:3]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
