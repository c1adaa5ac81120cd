"""The inputs of each diffusers transformer in ``real_models.py``: its conditions and its call.

For each architecture, ``<name>_conditions(config, shape, batch_size, generator)`` makes the
synthetic conditions of a batch (text embeddings, masks, pooled projections, class labels) and
``<name>_run(model, config, noisy, t, batch)`` calls the model's ``forward`` the way its
pipeline does and returns the prediction in the latents' layout.

:class:`LatentShape` (one sample's latent size) lives here, below ``real_model_spec.py`` and
``real_models.py``, which import this module and never the other way round.

Example:
    >>> batch = {"labels": torch.zeros(2, dtype=torch.long)}
    >>> dit_run(model, dict(model.config), noisy, t, batch).shape == noisy.shape
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from litegen.families.flux import Flux
from litegen.families.ltx_video import LTXVideo
from litegen.families.wan import Wan

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LatentShape:
    """One sample's latent size in VAE-latent units (``frames=1`` for images), and text length."""

    height: int
    width: int
    frames: int = 1
    text_tokens: int = 0


def unwrapped(model: nn.Module) -> nn.Module:
    """The diffusers module inside FSDP1's or DDP's wrapper (its ``config`` lives there)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def text(gen: torch.Generator, batch_size: int, tokens: int, dim: int) -> torch.Tensor:
    return torch.randn(batch_size, tokens, dim, generator=gen)


def text_mask(gen: torch.Generator, batch_size: int, tokens: int) -> torch.Tensor:
    """1 for real tokens, 0 for padding: each caption keeps at least its first token."""
    lengths = torch.randint(1, tokens + 1, (batch_size, 1), generator=gen)
    return (torch.arange(tokens) < lengths).long()


def sample(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


# -- DiT: class-conditional, learned sigma (the prediction's second half) --------------------
def dit_conditions(config: dict, shape: LatentShape, b: int, gen: torch.Generator) -> Batch:
    return {"class_labels": torch.randint(0, config["num_embeds_ada_norm"], (b,), generator=gen)}


def dit_run(model, config, noisy, t, batch) -> torch.Tensor:
    out = model(noisy, timestep=t * 1000, class_labels=batch["class_labels"], return_dict=False)
    return sample(out)[:, : config["in_channels"]]


# -- PixArt-alpha: T5 captions with a padding mask, learned sigma ----------------------------
def pixart_conditions(config: dict, shape: LatentShape, b: int, gen: torch.Generator) -> Batch:
    return {
        "text": text(gen, b, shape.text_tokens, config["caption_channels"]),
        "text_mask": text_mask(gen, b, shape.text_tokens),
    }


def pixart_run(model, config, noisy, t, batch) -> torch.Tensor:
    out = model(
        noisy,
        encoder_hidden_states=batch["text"],
        encoder_attention_mask=batch["text_mask"],
        timestep=t * 1000,
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        return_dict=False,
    )
    return sample(out)[:, : config["in_channels"]]


# -- SD3 (MMDiT): joint text tokens and a pooled CLIP projection -----------------------------
def sd3_conditions(config: dict, shape: LatentShape, b: int, gen: torch.Generator) -> Batch:
    return {
        "text": text(gen, b, shape.text_tokens, config["joint_attention_dim"]),
        "pooled": torch.randn(b, config["pooled_projection_dim"], generator=gen),
    }


def sd3_run(model, config, noisy, t, batch) -> torch.Tensor:
    out = model(
        noisy,
        encoder_hidden_states=batch["text"],
        pooled_projections=batch["pooled"],
        timestep=t * 1000,
        return_dict=False,
    )
    return sample(out)


# -- Flux: 2x2 latent patches packed into tokens, positions as 3-axis ids, distilled guidance -
def flux_conditions(config: dict, shape: LatentShape, b: int, gen: torch.Generator) -> Batch:
    return {
        "text": text(gen, b, shape.text_tokens, config["joint_attention_dim"]),
        "pooled": torch.randn(b, config["pooled_projection_dim"], generator=gen),
        "guidance": torch.full((b,), 3.5),
    }


def flux_run(model, config, noisy, t, batch) -> torch.Tensor:
    conditions = {"prompt_embeds": batch["text"], "pooled": batch["pooled"]}
    return Flux().predict(model, noisy, t, conditions | {"guidance": batch["guidance"]})


# -- Wan 2.1: umT5 text tokens, video latents (b, c, f, h, w) -------------------------------
def wan_conditions(config: dict, shape: LatentShape, b: int, gen: torch.Generator) -> Batch:
    return {"text": text(gen, b, shape.text_tokens, config["text_dim"])}


def wan_run(model, config, noisy, t, batch) -> torch.Tensor:
    return Wan().predict(model, noisy, t, {"prompt_embeds": batch["text"]})


# -- CogVideoX: frames before channels (b, f, c, h, w), text of max_text_seq_length tokens ----
def cogvideox_conditions(config: dict, shape: LatentShape, b: int, gen: torch.Generator) -> Batch:
    return {"text": text(gen, b, shape.text_tokens, config["text_embed_dim"])}


def cogvideox_run(model, config, noisy, t, batch) -> torch.Tensor:
    out = model(noisy, encoder_hidden_states=batch["text"], timestep=t * 1000, return_dict=False)
    return sample(out)


# -- HunyuanVideo: LLaMA text with a mask, pooled CLIP, distilled guidance -------------------
def hunyuan_conditions(config: dict, shape: LatentShape, b: int, gen: torch.Generator) -> Batch:
    return {
        "text": text(gen, b, shape.text_tokens, config["text_embed_dim"]),
        "text_mask": text_mask(gen, b, shape.text_tokens),
        "pooled": torch.randn(b, config["pooled_projection_dim"], generator=gen),
        "guidance": torch.full((b,), 6.0 * 1000),
    }


def hunyuan_run(model, config, noisy, t, batch) -> torch.Tensor:
    out = model(
        noisy,
        timestep=t * 1000,
        encoder_hidden_states=batch["text"],
        encoder_attention_mask=batch["text_mask"],
        pooled_projections=batch["pooled"],
        guidance=batch["guidance"] if config["guidance_embeds"] else None,
        return_dict=False,
    )
    return sample(out)


# -- LTX-Video: latents flattened to tokens (patch size 1), T5 text with a mask --------------
def ltx_conditions(config: dict, shape: LatentShape, b: int, gen: torch.Generator) -> Batch:
    return {
        "text": text(gen, b, shape.text_tokens, config["caption_channels"]),
        "text_mask": text_mask(gen, b, shape.text_tokens),
    }


def ltx_run(model, config, noisy, t, batch) -> torch.Tensor:
    conditions = {"prompt_embeds": batch["text"], "prompt_attention_mask": batch["text_mask"]}
    return LTXVideo().predict(model, noisy, t, conditions)
