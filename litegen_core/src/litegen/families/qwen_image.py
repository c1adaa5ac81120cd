"""Qwen-Image text-to-image (``QwenImagePipeline``, ``QwenImageTransformer2DModel``).

Latents: ``AutoencoderKLQwenImage``, a Wan-like VAE (8x in space) run on one-frame clips,
normalised by the VAE config's ``latents_mean`` and ``latents_std``, then packed into 2x2
patches (the transformer's tokens, as Flux). Condition: the last hidden state of the
Qwen2.5-VL text encoder over the pipeline's chat template, the template's first
``prompt_template_encode_start_idx`` tokens dropped, with its padding mask. The cache pads
every caption to one length (the tokenizer's, at most 512: the pipeline's
``max_sequence_length``) so that samples batch; the training forward trims the batch to its
longest caption, which the mask makes exact. The transformer takes the noise level itself as
its timestep, ``img_shapes`` (frames, rows, columns of packed tokens) for its rotary
embedding and the text mask. The scheduler shifts the noise levels by the token count
(``use_dynamic_shifting``); ``shift_terminal`` only stretches the sampling schedule.

Validation samples use true classifier-free guidance (``true_cfg_scale``, with an empty
negative prompt) when ``trainer.validation.guidance`` is above 1. Original-format LoRA files
keep diffusers' module names under ``diffusion_model.`` (the names of Qwen's checkpoint and
ComfyUI's). No sequence-parallel plan: the text and image streams attend jointly as [text,
image] with a text mask the attention processor builds at the local image length, so a split
needs that mask rebuilt over the gathered tokens (and diffusers' own ``_cp_plan`` names
``transformer_blocks.*`` inputs, which LiteGen's reader refuses).

Qwen-Image-Edit: a batch with ``reference_latents`` (normalised latents of a reference image,
any size) trains ``QwenImageEditPipeline``'s forward: their packed tokens follow the noisy
ones with their own ``img_shapes`` entry, and the prediction is the noisy tokens' part. Its
family, whose text encoder reads the reference with the caption, is
:mod:`litegen.families.qwen_image_edit`.

The tiny pipeline's tokenizer is a byte-level BPE trained offline on the chat templates, so
its template prefix is 34 tokens as Qwen's own: the pipeline drops exactly the template.

Example::

    from litegen.families.qwen_image import QwenImage

    pipe = QwenImage.tiny_pipeline()  # a QwenImagePipeline at QwenImage.tiny_config
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from litegen.families.base import (
    Family,
    LatentRules,
    max_length,
    model_dtype,
    pipeline_settings,
)
from litegen.model_keys.key_map import KeyMap

if TYPE_CHECKING:
    import torch

# Qwen-Image's checkpoint (and ComfyUI's model) name the transformer's modules as diffusers
# does; LoRA files carry them under diffusion_model., which diffusers' Qwen loader strips.
_BLOCK_LINEARS = (
    "img_mod.1",
    "txt_mod.1",
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_out.0",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
    "attn.norm_q",
    "attn.norm_k",
    "attn.norm_added_q",
    "attn.norm_added_k",
)
_OUTER = (
    "img_in",
    "txt_in",
    "txt_norm",
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "norm_out.linear",
    "proj_out",
)
_NAMES = (*_OUTER, *(f"transformer_blocks.{{i}}.{name}" for name in _BLOCK_LINEARS))
ORIGINAL_KEYS = KeyMap(modules={name: (name,) for name in _NAMES})


def tiny_qwen_vae() -> Any:
    """An ``AutoencoderKLQwenImage`` compressing 8x with 4 channels, normalised by a mean and
    std other than 0 and 1 (so a test sees a normalisation left out)."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.1, 0.2, 0.0],
        latents_std=[0.5, 1.5, 1.0, 2.0],
    )


def latent_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE config's per-channel mean and std, shaped (1, C, 1, 1, 1) like ``like``."""
    import torch

    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like)
    return mean, std


def encode_images(vae: Any, pixels: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """(B, 3, H, W) images in [-1, 1] -> normalised (B, C, H/8, W/8) latents (the VAE's mode)."""
    from litegen.data.vae_encode import vae_encode

    latents = vae_encode(
        vae, pixels.unsqueeze(2), micro_batch_size=micro_batch_size, sample=False, scale=False
    )
    mean, std = latent_stats(vae, latents)
    return ((latents - mean) / std).squeeze(2)


def text_conditions(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> dict:
    """The pipeline's text embeddings and mask, padded or cut to ``length`` tokens."""
    import torch

    b, n, _ = embeds.shape
    if mask is None:  # the pipeline drops an all-ones mask
        mask = torch.ones(b, n, dtype=torch.long, device=embeds.device)
    embeds, mask = embeds[:, :length], mask[:, :length].long()
    pad = length - embeds.shape[1]
    if pad:
        embeds = torch.cat([embeds, embeds.new_zeros(b, pad, embeds.shape[2])], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, pad)], dim=1)
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


def trimmed_text(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple:
    """The batch's text embeddings and mask cut to its longest caption (the rest is padding,
    which the mask hides: the cut changes no output). A batch without a mask is all text."""
    embeds = batch["prompt_embeds"].to(dtype)
    mask = batch.get("prompt_embeds_mask")
    if mask is None:
        return embeds, None
    length = int(mask.sum(dim=1).max())
    return embeds[:, :length], mask[:, :length]


@contextlib.contextmanager
def last_text_stream(model: Any, text_output: int) -> Iterator[list[torch.Tensor]]:
    """The text stream out of the transformer's last dual-stream block (output number
    ``text_output`` of ``transformer_blocks[-1]``), caught during a forward.

    In an MMDiT whose prediction is the image stream, the last block's text output (its
    ``attn.to_add_out`` and text MLP) feeds nothing. Adding ``0 * text.sum()`` to the
    prediction gives those parameters zero gradients instead of none, as DDP's reducer needs
    of every parameter.
    """
    while not hasattr(model, "transformer_blocks") and hasattr(model, "module"):
        model = model.module  # DDP
    caught: list[torch.Tensor] = []

    def catch(module: Any, args: Any, out: tuple[torch.Tensor, ...]) -> None:
        caught[:] = [out[text_output]]  # a recomputation under checkpointing catches again

    handle = model.transformer_blocks[-1].register_forward_hook(catch)
    try:
        yield caught
    finally:
        handle.remove()


class QwenImage(Family):
    """Qwen-Image text-to-image: Qwen2.5-VL embeddings with a mask, 2x2-packed latents."""

    name = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    transformer_class = "QwenImageTransformer2DModel"
    original_keys = ORIGINAL_KEYS
    frozen = ("vae", "text_encoder")
    latent = LatentRules(
        spatial_compression=8,
        patch_size=2,
        normalisation="(z - latents_mean) / latents_std, then 2x2 patches packed as tokens",
    )
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": "Qwen2.5-VL's last hidden state after the chat template, padded to "
        "the tokenizer length (at most 512)",
        "prompt_embeds_mask": "1 for the caption's tokens, 0 for the padding",
    }
    reference_config: ClassVar[dict[str, Any]] = {  # Qwen/Qwen-Image/transformer
        "patch_size": 2,
        "in_channels": 64,
        "out_channels": 16,
        "num_layers": 60,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 3584,
        "guidance_embeds": False,
        "axes_dims_rope": (16, 56, 56),
    }
    tiny_config: ClassVar[dict[str, Any]] = {  # two blocks: FSDP units and checkpointing
        "patch_size": 2,
        "in_channels": 16,  # 4 latent channels in 2x2 patches
        "out_channels": 4,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "axes_dims_rope": (4, 6, 6),
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``QwenImagePipeline``: a tiny Qwen2.5-VL, a Qwen-Image VAE, the MMDiT."""
        import torch
        from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

        torch.manual_seed(seed)
        from litegen.families.tiny_qwen import tiny_qwen_tokenizer, tiny_qwen_vl

        tokenizer = tiny_qwen_tokenizer(32)
        return QwenImagePipeline(
            scheduler=tiny_scheduler(),
            vae=tiny_qwen_vae(),
            text_encoder=tiny_qwen_vl(tokenizer),
            tokenizer=tokenizer,
            transformer=QwenImageTransformer2DModel(**cls.tiny_config),
        )

    def encode_latents(self, pipe, pixels, micro_batch_size):
        return encode_images(pipe.vae, pixels, micro_batch_size)

    def encode_text(self, pipe, captions):
        length = max_length(pipe.tokenizer)
        embeds, mask = pipe.encode_prompt(captions, device=pipe.device, max_sequence_length=length)
        return text_conditions(embeds, mask, length)

    def predict(self, model, noisy, sigmas, batch):
        import torch

        from litegen.families.packing import pack, unpack

        b, _, h, w = noisy.shape
        dtype = model_dtype(model)
        text, mask = trimmed_text(batch, dtype)
        tokens, shapes = pack(noisy).to(dtype), [(1, h // 2, w // 2)]
        reference = batch.get("reference_latents")
        if reference is not None:  # Qwen-Image-Edit's: tokens after the noisy ones
            tokens = torch.cat([tokens, pack(reference).to(dtype)], dim=1)
            shapes.append((1, reference.shape[-2] // 2, reference.shape[-1] // 2))
        with last_text_stream(model, text_output=0) as text_out:
            prediction = model(
                hidden_states=tokens,
                timestep=sigmas.to(dtype),  # the pipeline passes timestep / 1000: the noise level
                encoder_hidden_states=text,
                encoder_hidden_states_mask=mask,
                img_shapes=[shapes] * b,
                return_dict=False,
            )[0]
        prediction = prediction[:, : (h // 2) * (w // 2)] + 0 * text_out[0].sum()
        return unpack(prediction, h, w)

    def sample(self, pipe, prompts, validation, generator):
        return pipe(
            prompt=prompts,
            **guidance_settings(validation),
            max_sequence_length=max_length(pipe.tokenizer),
            generator=generator,
            output_type="pt",
        ).images  # (N, C, H, W) in [0, 1]


def tiny_scheduler() -> Any:
    """Qwen-Image's scheduler settings at the tiny pipeline's token counts (16 to 256)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_image_seq_len=16,
        max_image_seq_len=256,
        base_shift=0.5,
        max_shift=0.9,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def guidance_settings(validation: Any) -> dict[str, Any]:
    """``trainer.validation``'s settings as Qwen's pipelines take them: the guidance is true
    classifier-free guidance against an empty negative prompt (``true_cfg_scale``)."""
    settings = pipeline_settings(validation)
    guidance = settings.pop("guidance_scale", None)
    if guidance is not None and guidance > 1:
        return {**settings, "true_cfg_scale": guidance, "negative_prompt": " "}
    return {**settings, "true_cfg_scale": 1.0}


__all__ = [
    "ORIGINAL_KEYS",
    "QwenImage",
    "encode_images",
    "last_text_stream",
    "text_conditions",
]
