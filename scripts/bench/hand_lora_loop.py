"""The LoRA fine-tuning loop a diffusers user writes by hand, timed: the reference that the
fine-tuning recipes are measured against (``finetune_vs_hand.py``).

The transformer of a diffusers pipeline folder (Wan 2.1 or Flux), its weights frozen in bf16,
peft adapters added with ``add_adapter`` and kept in FP32 (diffusers' ``cast_training_params``),
the forward under bf16 autocast, fused AdamW over the adapters, gradient clipping, an FP32 EMA
of the adapters (one ``torch._foreach_lerp_``), and the flow-matching loss the recipes train
with (logit-normal noise levels, the scheduler's shift, velocity target). Optionally each
transformer block is compiled (``torch.compile`` of its ``forward``, as users do for regional
compile). No LiteGen code runs in the loop; latents and text embeddings are random (batch 1),
held in pinned host memory and copied to the GPU at every step, as a DataLoader with
``pin_memory`` hands them over. The loss is read back every ``--log-every`` steps, as a user
logs it. ``--profile FIRST,LAST`` traces steps ``[FIRST, LAST)`` (1-based) with torch.profiler
and writes ``profile.json`` and ``profile_trace.json.gz`` beside ``--out``
(``scripts/lab/step_profile.py``), as the recipe's ``scripts.lab.profiled_finetune`` entry does.

Prints one JSON line: samples/s (the median over windows of ``--window`` steps after
``--warmup`` steps, each step timed by CUDA events), the peak of allocated memory in GiB, and
the shapes.

    python3 scripts/bench/hand_lora_loop.py --pipeline DIR --family wan --frames 49 \\
        --height 352 --width 640 --compile
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

# The inductor options compiled regions need for correct gradients (litegen/compile.py says
# why); a careful user sets them too. The only LiteGen code the loop uses.
from litegen.compile import correct_gradient_options
from scripts.lab.step_profile import StepProfiler


def load_transformer(folder: Path, family: str) -> nn.Module:
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    cls = WanTransformer3DModel if family == "wan" else FluxTransformer2DModel
    return cls.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.bfloat16)


def scheduler_shift(folder: Path, tokens: int) -> float:
    """The noise-level shift the pipeline's scheduler samples ``tokens`` latent tokens with."""
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    if not config.get("use_dynamic_shifting"):
        return float(config.get("shift", config.get("flow_shift", 1.0)))
    base, top = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    low, high = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    return math.exp(low + (high - low) / (top - base) * (tokens - base))


def _host_tensors(shapes: dict[str, tuple[int, ...]], pin: bool) -> dict[str, torch.Tensor]:
    """Random bf16 tensors in host memory (pinned for copies to a GPU), as the cache holds."""
    tensors = {name: torch.randn(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    return {name: t.pin_memory() if pin else t for name, t in tensors.items()}


class WanInputs:
    """Wan 2.1: latents ``(B, C, F, H, W)`` (4x in time, 8x in space) and UMT5 embeddings."""

    def __init__(self, model, batch, frames, height, width, text_tokens) -> None:
        c = model.config.in_channels
        self.latent_shape = (batch, c, (frames - 1) // 4 + 1, height // 8, width // 8)
        self.text_shape = (batch, text_tokens, model.config.text_dim)
        p = model.config.patch_size
        self.tokens = math.prod(s // q for s, q in zip(self.latent_shape[2:], p, strict=True))

    def host_sample(self, pin: bool) -> dict[str, torch.Tensor]:
        shapes = {"latents": self.latent_shape, "prompt_embeds": self.text_shape}
        return _host_tensors(shapes, pin)

    def forward(self, model, batch, noisy, sigmas):
        return model(
            hidden_states=noisy.bfloat16(),
            timestep=sigmas * 1000,
            encoder_hidden_states=batch["prompt_embeds"],
            return_dict=False,
        )[0]

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return latents


class FluxInputs:
    """Flux: latents packed into 2x2 patches ``(B, N, 4C)``, T5 and pooled CLIP embeddings."""

    def __init__(self, model, batch, frames, height, width, text_tokens) -> None:
        self.h, self.w = height // 8, width // 8
        self.latent_shape = (batch, model.config.in_channels // 4, self.h, self.w)
        self.text_shape = (batch, text_tokens, model.config.joint_attention_dim)
        self.pooled_shape = (batch, model.config.pooled_projection_dim)
        self.tokens = (self.h // 2) * (self.w // 2)
        self.guidance = model.config.guidance_embeds

    def host_sample(self, pin: bool) -> dict[str, torch.Tensor]:
        shapes = {
            "latents": self.latent_shape,
            "prompt_embeds": self.text_shape,
            "pooled": self.pooled_shape,
        }
        return _host_tensors(shapes, pin)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(b, (h // 2) * (w // 2), c * 4)

    def forward(self, model, batch, noisy, sigmas):
        device, b = noisy.device, noisy.shape[0]
        rows = torch.arange(self.h // 2, device=device)
        cols = torch.arange(self.w // 2, device=device)
        image_ids = torch.zeros(self.h // 2, self.w // 2, 3, device=device)
        image_ids[..., 1] = rows[:, None]
        image_ids[..., 2] = cols[None, :]
        text_ids = torch.zeros(self.text_shape[1], 3, device=device)
        return model(
            hidden_states=noisy.bfloat16(),
            timestep=sigmas,
            guidance=torch.ones(b, device=device) if self.guidance else None,
            pooled_projections=batch["pooled"],
            encoder_hidden_states=batch["prompt_embeds"],
            txt_ids=text_ids,
            img_ids=image_ids.reshape(-1, 3),
            return_dict=False,
        )[0]


def add_lora(model: nn.Module, rank: int, alpha: float, targets: list[str]) -> list[nn.Parameter]:
    """peft adapters through diffusers' ``add_adapter``, trained in FP32."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))
    cast_training_params(model, dtype=torch.float32)
    return [p for p in model.parameters() if p.requires_grad]


def compile_blocks(model: nn.Module) -> int:
    """``torch.compile`` each block's ``forward`` (the hooks of the module stay outside)."""
    count = 0
    for child in model.children():
        if isinstance(child, nn.ModuleList) and len(child) > 1:
            for block in child:
                block.forward = torch.compile(block.forward, options=correct_gradient_options())
                count += 1
    return count


class StepClock:
    """Step ends timed by CUDA events (read once, after the loop), or the host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds of each interval between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]
        return [b - a for a, b in itertools.pairwise(self.marks)]


def train(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    if args.attention != "default":  # the same kernel as a launch with that attention_backend
        for name in ("cudnn", "flash", "efficient"):
            enable = getattr(
                torch.backends.cuda,
                f"enable_{'mem_efficient' if name == 'efficient' else name}_sdp",
            )
            enable(name == args.attention)
    folder = Path(args.pipeline)
    model = load_transformer(folder, args.family).to(device)
    trained = add_lora(model, args.rank, args.alpha, args.targets)
    model.train()
    compiled = compile_blocks(model) if args.compile else 0
    inputs_cls = WanInputs if args.family == "wan" else FluxInputs
    inputs = inputs_cls(model, args.batch, args.frames, args.height, args.width, args.text_tokens)
    shift = scheduler_shift(folder, inputs.tokens)
    optimizer = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.0, fused=cuda)
    ema = [p.detach().clone() for p in trained]
    samples = [inputs.host_sample(pin=cuda) for _ in range(2)]
    steps = args.warmup + args.window * args.windows
    losses = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    started = time.time()
    profiler = StepProfiler(*args.profile) if args.profile else None
    clock = StepClock(device)
    clock.mark()
    for step in range(steps):
        if profiler is not None:
            profiler.at_step(step + 1)
        host = samples[step % len(samples)]
        batch = {k: v.to(device, non_blocking=True) for k, v in host.items()}
        x0 = inputs.pack(batch["latents"].float())
        noise = torch.randn_like(x0)
        u = torch.sigmoid(torch.randn(x0.shape[0], device=device))  # logit-normal
        sigmas = shift * u / (1 + (shift - 1) * u)
        sigma = sigmas.view(-1, *([1] * (x0.dim() - 1)))
        noisy = (1 - sigma) * x0 + sigma * noise
        with torch.autocast(device.type, dtype=torch.bfloat16):
            prediction = inputs.forward(model, batch, noisy, sigmas)
        loss = nn.functional.mse_loss(prediction.float(), noise - x0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in trained], 1.0 - args.ema_decay)
        clock.mark()
        if (step + 1) % args.log_every == 0:
            losses.append(loss.item())
    seconds = clock.seconds()
    rates = [
        args.window * args.batch / sum(seconds[start : start + args.window])
        for start in range(args.warmup, steps, args.window)
    ]
    if profiler is not None and args.out is not None:
        profiler.write(args.out.parent)
    return {
        "samples_per_s": statistics.median(rates),
        "window_rates": rates,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "tokens": inputs.tokens,
        "latent_shape": list(inputs.latent_shape),
        "text_tokens": args.text_tokens,
        "compiled_blocks": compiled,
        "adapter_params": sum(p.numel() for p in trained),
        "losses": losses,
        "seconds": time.time() - started,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True, help="diffusers pipeline folder")
    parser.add_argument("--family", choices=("wan", "flux"), required=True)
    parser.add_argument("--frames", type=int, default=1, help="pixel frames (Wan: 4k+1)")
    parser.add_argument("--height", type=int, required=True, help="pixels")
    parser.add_argument("--width", type=int, required=True, help="pixels")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", nargs="+", default=["to_q", "to_k", "to_v", "to_out.0"])
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--ema-decay", type=float, default=0.99)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument(
        "--attention",
        choices=("default", "cudnn", "flash", "efficient"),
        default="default",
        help="the only SDPA kernel to use (default: torch's choice)",
    )
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the rate")
    parser.add_argument("--window", type=int, default=10, help="steps per timed window")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=10, help="loss.item() every N steps")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument(
        "--profile",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        metavar="FIRST,LAST",
        help="trace steps [FIRST, LAST) into --out's folder",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    result = train(args)
    line = json.dumps(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n", encoding="utf-8")
    print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
