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
from digits_dit import NUM_CLASSES, Digits, euler_sample, flow_loss, make_optimizer, save_grid
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
    """Rank 0 draws one row of samples per digit: with LoRA, from a fresh model given the EMA
    adapter file through diffusers' loader (on the init_from base when set); with
    ``optimization.lora: null`` (training a base), from the full EMA weights."""
    if config.optimization.lora is None:
        state = gen.full_sampling_state()  # collective: every rank calls it
        if not gen.is_main_process:
            return
        sampler = make_transformer(config)
        sampler.load_state_dict(state)
    else:
        if not gen.is_main_process:
            return
        sampler = fine_tuned(config)
    per_class = config.sampling.per_class
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    forward = conditioned(sampler.eval(), class_tokens(config))
    images = euler_sample(forward, labels, config.sampling.steps, config.sampling.guidance, 0)
    cells = images.clamp(-1, 1).reshape(NUM_CLASSES, per_class, 8, 8)
    save_grid(cells, Path(config.get_results_dir()) / "samples.png")


def fine_tuned(config) -> WanTransformer3DModel:
    """A fresh model with the base weights (init_from, else the seeded initialisation) and the
    run's adapter file (the EMA's when kept), loaded as ``pipe.load_lora_weights`` would."""
    folder = Path(config.get_checkpoint_dir())
    adapters = folder / f"{config.exp_name}.ema.lora.safetensors"
    if not adapters.is_file():  # ema.enable: false
        adapters = folder / f"{config.exp_name}.lora.safetensors"
    torch.manual_seed(config.global_seed)  # the base build(config) made, when not init_from
    model = make_transformer(config)
    if config.init_from:
        model.load_state_dict(load_state(config.init_from))
    state, metadata = WanLoraLoaderMixin.lora_state_dict(str(adapters), return_lora_metadata=True)
    WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=model, metadata=metadata)
    print(f"adapters loaded through diffusers from {adapters}")
    return model
