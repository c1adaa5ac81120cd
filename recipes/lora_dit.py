"""Entry module of recipes/lora_dit.yaml: LoRA on a diffusers WanTransformer3DModel, 8x8 digits.

    uv run litegen launch recipes/lora_dit.yaml

``build`` returns the plain diffusers model and an AdamW over all its parameters: LiteGen's
``prepare`` injects the adapters of ``optimization.lora`` and rebinds the optimizer to them.
Digits are one-frame videos; the class is the "text": a fixed random token per class stands in
for a frozen text encoder. The loss and sampler are digits_dit.py's rectified flow. ``finish``
loads the saved adapter file into a fresh model through diffusers' LoRA loader (the code
behind ``pipe.load_lora_weights``) and draws a grid of samples with it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders import WanLoraLoaderMixin
from digits_dit import NUM_CLASSES, Digits, flow_loss, make_optimizer, sample, save_grid
from torch import nn

from litegen.checkpoint import load_state


def make_transformer(config) -> WanTransformer3DModel:
    """A small Wan 2.1 transformer for 1x1x8x8 latents, sized by the recipe's ``model``."""
    m = config.model
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=m.num_heads,
        attention_head_dim=m.head_dim,
        in_channels=1,
        out_channels=1,
        text_dim=m.text_dim,
        freq_dim=64,
        ffn_dim=m.ffn_dim,
        num_layers=m.depth,
        rope_max_seq_len=64,
    )


def class_tokens(config) -> torch.Tensor:
    """One fixed "text" token per class (the last one: no class), the same on every rank."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(NUM_CLASSES + 1, 1, config.model.text_dim, generator=generator)


def conditioned(model: nn.Module, tokens: torch.Tensor):
    """``model(x, t, labels)`` for digits_dit's loss and sampler: images become one-frame
    videos, t in [0, 1] becomes diffusers' timestep in [0, 1000], labels become tokens."""

    def forward(x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        text = tokens.to(x.device)[labels]
        out = model(x.unsqueeze(2), t * 1000, text, return_dict=False)[0]
        return out.squeeze(2)

    return forward


def build(config):
    """The diffusers model, an optimizer over all of it (prepare narrows it), the digits."""
    model = make_transformer(config)
    optimizer, scheduler = make_optimizer(model, config)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "dataset": Digits()}


def train_step(batch, model, config):
    """Rectified-flow loss of one micro-batch of digits."""
    images, labels = batch
    return flow_loss(conditioned(model, class_tokens(config)), images, labels, config)


def finish(gen, config):
    """Rank 0 loads the EMA adapter file into a fresh model (base weights from init_from when
    set) with diffusers' loader and draws one row of samples per digit."""
    if not gen.is_main_process:
        return
    folder = Path(config.get_checkpoint_dir())
    adapters = folder / f"{config.exp_name}.ema.lora.safetensors"
    if not adapters.is_file():  # ema.enable: false
        adapters = folder / f"{config.exp_name}.lora.safetensors"
    sampler = make_transformer(config)
    if config.init_from:
        sampler.load_state_dict(load_state(config.init_from))
    state, metadata = WanLoraLoaderMixin.lora_state_dict(str(adapters), return_lora_metadata=True)
    WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=sampler, metadata=metadata)
    sampler.eval()
    per_class = config.sampling.per_class
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    forward = conditioned(sampler, class_tokens(config))
    images = sample(forward, labels, config.sampling.steps, config.sampling.guidance, 0)
    cells = images.clamp(-1, 1).reshape(NUM_CLASSES, per_class, 8, 8)
    save_grid(cells, Path(config.get_results_dir()) / "samples.png")
    print(f"adapters loaded through diffusers from {adapters}")
