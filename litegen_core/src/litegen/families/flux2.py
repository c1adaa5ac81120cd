"""Flux.2 text-to-image (``Flux2Pipeline``, ``Flux2Transformer2DModel``, ``AutoencoderKLFlux2``).

Latents: ``AutoencoderKLFlux2`` compresses 8x into 32 channels (the tiny one: 4). The pipeline
patchifies them 2x2 into 128 channels and normalises each of those with the VAE's batch-norm
statistics, ``(z - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps)``; the tokens are
the patchified latents flattened. LiteGen caches the normalised latents un-patchified, as
``(B, 32, H/8, W/8)`` (each pixel of the latent normalised by the statistics of its channel and
place in its 2x2 patch): the flow-matching loss is the same in either layout, and the cache
keeps the VAE's shape. The training forward patchifies and flattens (:func:`packing.pack`, whose
channel order is the pipeline's), and undoes it on the prediction.

Conditions: the text encoder's hidden states at three of its layers (10, 20 and 30 of FLUX.2-dev's
Mistral-Small-3.1 encoder), stacked per token into one embedding. The transformer takes the
noise level itself as its timestep, 4-axis position ids (T, H, W, L) for its rotary embedding
((0, 0, 0, token) for the text, (0, row, column, 0) for the image) and, when
guidance-distilled (FLUX.2-dev), a guidance scale: trained at 1.0, as Flux.1. Noise levels are
shifted as the pipeline samples them: ``exp(mu)`` with the pipeline's empirical ``mu`` of the
token count at its default 50 steps.

The tiny pipeline differs from FLUX.2-dev in its tokenizer: FLUX.2-dev's is a
``PixtralProcessor``, which needs torchvision; the tiny one is a plain fast tokenizer with a
chat template, which is all ``encode_prompt`` uses (``apply_chat_template`` over the system
and user messages). Its text encoder is a three-layer ``Mistral3ForConditionalGeneration``;
the family takes layers (1, 2, 3) of an encoder too shallow for the published ones.

The original-format LoRA (``diffusion_model.`` + Black Forest Labs' names: fused ``qkv`` of the
double blocks, ``linear1`` of the single blocks fused by the model itself) loads in diffusers'
``Flux2Pipeline.load_lora_weights``, except a LoRA on ``norm_out.linear``: the original holds
its rows as (shift, scale), which LiteGen writes and diffusers' single-file loader swaps, but
diffusers 0.42.1's Flux.2 LoRA converter does not swap them. That file carries no ``alpha``
(diffusers' reader refuses one): each module's ``alpha / rank`` is multiplied into its
``lora_B``, which ComfyUI, reading a missing alpha as scale 1, reads alike.

Sequence parallelism: no plan of its own; LiteGen reads diffusers' ``_cp_plan`` (the image
tokens and their position ids split, the text whole, the joint attention text first); the
forward passes the ids with a batch axis of one, as the pipeline does and that plan expects.
Flux.2 [klein] (``Flux2KleinPipeline``, a Qwen3 encoder) is its variant:
:mod:`litegen.families.flux2_klein`.

Reference-image editing: the optional ``reference`` media condition (a ``reference`` column of
the folder's metadata, or a companion file ``<stem>.reference.<ext>``; for every file or for
none), one reference image per sample, read at the target's bucket. Its latents, normalised as
the target's, are appended after the noisy target's tokens with position ids (10, row, column,
0), the first reference of the pipeline's ``image=``; the prediction is cut back to the target's
tokens. Samples then take one ``trainer.validation.conditions.reference`` image per prompt
(at least 64 pixels a side, which the pipeline requires; it resizes only past 1024x1024
pixels). Several references per sample are not
trained.

Example::

    from litegen.families.flux2 import Flux2

    pipe = Flux2.tiny_pipeline()  # a Flux2Pipeline at Flux2.tiny_config, random weights
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from litegen.families.base import (
    Family,
    LatentRules,
    MediaCondition,
    max_length,
    model_config,
    model_dtype,
    pipeline_settings,
)
from litegen.model_keys.key_map import KeyMap

if TYPE_CHECKING:
    import torch

TINY_TEXT_LAYERS = (1, 2, 3)  # the tiny encoders' layers (they have three)
SAMPLE_STEPS = 50  # the pipeline's default step count, for its resolution shift
REFERENCE = "reference_latents"  # the batch key of an encoded reference image


def text_layers(pipe: Any, published: tuple[int, ...]) -> tuple[int, ...]:
    """The encoder layers the text embedding stacks: the ``published`` model's, or (1, 2, 3)
    for an encoder too shallow to have them (a tiny pipeline)."""
    config = pipe.text_encoder.config
    depth = getattr(config, "text_config", config).num_hidden_layers
    return published if depth >= max(published) else TINY_TEXT_LAYERS


def empirical_mu(seq_len: int, steps: int = SAMPLE_STEPS) -> float:
    """The ``mu`` Flux2Pipeline samples ``seq_len`` tokens with over ``steps`` steps: linear in
    the step count between two lines in the token count (fitted by Black Forest Labs), and the
    200-step line alone past 4300 tokens."""
    slope_10, intercept_10 = 8.73809524e-05, 1.89833333
    slope_200, intercept_200 = 0.00016927, 0.45666666
    mu_200 = slope_200 * seq_len + intercept_200
    if seq_len > 4300:
        return mu_200
    mu_10 = slope_10 * seq_len + intercept_10
    per_step = (mu_200 - mu_10) / 190.0
    return mu_200 + per_step * (steps - 200)


def latent_ids(
    height: int, width: int, device: torch.device | str = "cpu", *, time: int = 0
) -> torch.Tensor:
    """(H/2 * W/2, 4) position ids of the patchified latent tokens: (time, row, column, 0); the
    pipeline's reference images take times 10, 20, ..., the image it draws 0."""
    import torch

    ids = torch.zeros(height // 2, width // 2, 4, device=device)
    ids[..., 0] = time
    ids[..., 1] = torch.arange(height // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(width // 2, device=device)[None, :]
    return ids.view(-1, 4)


def text_ids(length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(L, 4) position ids of the text tokens: (0, 0, 0, token)."""
    import torch

    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def batch_norm_stats(vae: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's latent mean and std per channel and place in a 2x2 patch, shaped
    (1, C, 1, 2, 1, 2) to broadcast over un-patchified latents viewed as (B, C, h, 2, w, 2)."""
    import torch

    channels = vae.config.latent_channels
    mean = vae.bn.running_mean.view(1, channels, 1, 2, 1, 2)
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, channels, 1, 2, 1, 2)
    return mean, std


def normalise(latents: torch.Tensor, vae: Any) -> torch.Tensor:
    """(B, C, H, W) VAE latents normalised as the pipeline does after patchifying them."""
    b, c, h, w = latents.shape
    mean, std = batch_norm_stats(vae)
    patches = latents.view(b, c, h // 2, 2, w // 2, 2)
    return ((patches - mean.to(latents)) / std.to(latents)).view(b, c, h, w)


# Flux.2 (Flux2Transformer2DModel) as Black Forest Labs' checkpoints name it: diffusers'
# single-file and LoRA converters read these names. The single blocks' linear1 is one fused
# Linear in diffusers too (to_qkv_mlp_proj), and the modulations are shared by all blocks.
MODULES: dict[str, tuple[str, ...]] = {
    "img_in": ("x_embedder",),
    "txt_in": ("context_embedder",),
    "time_in.in_layer": ("time_guidance_embed.timestep_embedder.linear_1",),
    "time_in.out_layer": ("time_guidance_embed.timestep_embedder.linear_2",),
    "guidance_in.in_layer": ("time_guidance_embed.guidance_embedder.linear_1",),
    "guidance_in.out_layer": ("time_guidance_embed.guidance_embedder.linear_2",),
    "double_stream_modulation_img.lin": ("double_stream_modulation_img.linear",),
    "double_stream_modulation_txt.lin": ("double_stream_modulation_txt.linear",),
    "single_stream_modulation.lin": ("single_stream_modulation.linear",),
    "double_blocks.{i}.img_attn.qkv": (
        "transformer_blocks.{i}.attn.to_q",
        "transformer_blocks.{i}.attn.to_k",
        "transformer_blocks.{i}.attn.to_v",
    ),
    "double_blocks.{i}.txt_attn.qkv": (
        "transformer_blocks.{i}.attn.add_q_proj",
        "transformer_blocks.{i}.attn.add_k_proj",
        "transformer_blocks.{i}.attn.add_v_proj",
    ),
    "double_blocks.{i}.img_attn.proj": ("transformer_blocks.{i}.attn.to_out.0",),
    "double_blocks.{i}.txt_attn.proj": ("transformer_blocks.{i}.attn.to_add_out",),
    # The SwiGLU's gate and value halves are one Linear in both layouts.
    "double_blocks.{i}.img_mlp.0": ("transformer_blocks.{i}.ff.linear_in",),
    "double_blocks.{i}.img_mlp.2": ("transformer_blocks.{i}.ff.linear_out",),
    "double_blocks.{i}.txt_mlp.0": ("transformer_blocks.{i}.ff_context.linear_in",),
    "double_blocks.{i}.txt_mlp.2": ("transformer_blocks.{i}.ff_context.linear_out",),
    "single_blocks.{i}.linear1": ("single_transformer_blocks.{i}.attn.to_qkv_mlp_proj",),
    "single_blocks.{i}.linear2": ("single_transformer_blocks.{i}.attn.to_out",),
    "final_layer.linear": ("proj_out",),
    # BFL's final modulation is (shift, scale); diffusers' norm_out.linear (scale, shift).
    "final_layer.adaLN_modulation.1": ("norm_out.linear[1/2]", "norm_out.linear[0/2]"),
}
ORIGINAL_KEYS = KeyMap(
    modules=MODULES,
    tensors={
        "double_blocks.{i}.img_attn.norm.query_norm.scale": "transformer_blocks.{i}.attn.norm_q.weight",
        "double_blocks.{i}.img_attn.norm.key_norm.scale": "transformer_blocks.{i}.attn.norm_k.weight",
        "double_blocks.{i}.txt_attn.norm.query_norm.scale": (
            "transformer_blocks.{i}.attn.norm_added_q.weight"
        ),
        "double_blocks.{i}.txt_attn.norm.key_norm.scale": (
            "transformer_blocks.{i}.attn.norm_added_k.weight"
        ),
        "single_blocks.{i}.norm.query_norm.scale": "single_transformer_blocks.{i}.attn.norm_q.weight",
        "single_blocks.{i}.norm.key_norm.scale": "single_transformer_blocks.{i}.attn.norm_k.weight",
    },
    # diffusers' Flux.2 converter refuses alpha keys: every module's scale goes into lora_B.
    scale_in_up=tuple(MODULES),
)


class Flux2(Family):
    """Flux.2 text-to-image: stacked Mistral hidden states, batch-norm-normalised 2x2 patches,
    4-axis rotary ids, the pipeline's empirical resolution shift."""

    name = "flux2"
    pipeline_class = "Flux2Pipeline"
    text_encoder_layers: ClassVar[tuple[int, ...]] = (10, 20, 30)  # FLUX.2-dev's Mistral
    transformer_class = "Flux2Transformer2DModel"
    original_keys = ORIGINAL_KEYS
    frozen = ("vae", "text_encoder")
    latent = LatentRules(
        spatial_compression=8,
        patch_size=2,
        normalisation=(
            "per channel of the 2x2-patchified latents: (z - bn.running_mean) / "
            "sqrt(bn.running_var + batch_norm_eps); cached un-patchified"
        ),
    )
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": (
            "the text encoder's hidden states at layers 10, 20 and 30, stacked per token "
            "(chat template with the pipeline's system message; tokenizer length, at most 512)"
        ),
        REFERENCE: "a reference image's latents, normalised as the target's (optional)",
    }
    media_conditions: ClassVar[dict[str, MediaCondition]] = {
        "reference": MediaCondition(
            "image", "an image the caption edits (one reference image)", optional=True
        ),
    }
    reference_config: ClassVar[dict[str, Any]] = {  # black-forest-labs/FLUX.2-dev/transformer
        "patch_size": 1,
        "in_channels": 128,
        "num_layers": 8,
        "num_single_layers": 48,
        "attention_head_dim": 128,
        "num_attention_heads": 48,
        "joint_attention_dim": 15360,
        "timestep_guidance_channels": 256,
        "mlp_ratio": 3.0,
        "axes_dims_rope": (32, 32, 32, 32),
        "rope_theta": 2000,
        "guidance_embeds": True,
    }
    tiny_config: ClassVar[dict[str, Any]] = {  # two of each block, for FSDP and checkpointing
        "patch_size": 1,
        "in_channels": 16,  # 4 latent channels in 2x2 patches
        "num_layers": 2,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 96,  # three layers of a width-32 encoder
        "timestep_guidance_channels": 32,
        "axes_dims_rope": (4, 4, 4, 4),
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``Flux2Pipeline``: a three-layer Mistral3 encoder with a chat-template tokenizer, an
        8x ``AutoencoderKLFlux2`` of 4 channels with random batch-norm statistics, the MMDiT."""
        import torch
        from diffusers import (
            FlowMatchEulerDiscreteScheduler,
            Flux2Pipeline,
            Flux2Transformer2DModel,
        )

        from litegen.families.tiny_flux2 import tiny_chat_tokenizer, tiny_mistral3_encoder, tiny_vae

        torch.manual_seed(seed)
        tokenizer = tiny_chat_tokenizer(64)
        return Flux2Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
            vae=tiny_vae(),
            text_encoder=tiny_mistral3_encoder(len(tokenizer), layers=3),
            tokenizer=tokenizer,
            transformer=Flux2Transformer2DModel(**cls.tiny_config),
        )

    def shift_for(self, seq_len: int) -> float | None:
        if not self.scheduler_config.get("use_dynamic_shifting"):
            return None
        return math.exp(empirical_mu(seq_len))

    def encode_latents(self, pipe, pixels, micro_batch_size):
        from litegen.data.vae_encode import vae_encode

        latents = vae_encode(
            pipe.vae, pixels, micro_batch_size=micro_batch_size, sample=False, scale=False
        )
        return normalise(latents, pipe.vae)

    def encode_text(self, pipe, captions):
        prompt_embeds, _ = pipe.encode_prompt(
            captions,
            device=pipe.device,
            max_sequence_length=max_length(pipe.tokenizer),
            text_encoder_out_layers=text_layers(pipe, self.text_encoder_layers),
        )
        return {"prompt_embeds": prompt_embeds}

    def encode_condition(self, pipe, name, pixels, clip, micro_batch_size):
        if name != "reference":
            return super().encode_condition(pipe, name, pixels, clip, micro_batch_size)
        return {REFERENCE: self.encode_latents(pipe, pixels, micro_batch_size)}

    def predict(self, model, noisy, sigmas, batch):
        import torch

        from litegen.families.packing import pack, unpack

        b, _, h, w = noisy.shape
        dtype = model_dtype(model)
        text = batch["prompt_embeds"].to(dtype)
        guidance = None
        if model_config(model).guidance_embeds:  # guidance-distilled (FLUX.2-dev): 1.0 unless given
            guidance = batch.get("guidance", torch.ones(b, device=noisy.device))
        tokens, ids = pack(noisy), latent_ids(h, w, noisy.device)
        target = tokens.shape[1]
        if REFERENCE in batch:  # after the target's tokens, as the pipeline appends its images
            reference = batch[REFERENCE].to(noisy)
            tokens = torch.cat([tokens, pack(reference)], dim=1)
            ids = torch.cat([ids, latent_ids(*reference.shape[-2:], noisy.device, time=10)])
        prediction = model(
            hidden_states=tokens.to(dtype),
            encoder_hidden_states=text,
            timestep=sigmas.to(dtype),  # Flux.2 takes timestep / 1000: the noise level itself
            guidance=guidance,
            # (1, S, 4), as the pipeline passes them and diffusers' _cp_plan splits them.
            img_ids=ids[None],
            txt_ids=text_ids(text.shape[1], noisy.device)[None],
            return_dict=False,
        )[0]
        return unpack(prediction[:, :target], h, w)  # the target's tokens

    def sample(self, pipe, prompts, validation, generator, conditions=None):
        settings = {
            **pipeline_settings(validation),
            "max_sequence_length": max_length(pipe.tokenizer),
            "text_encoder_out_layers": text_layers(pipe, self.text_encoder_layers),
            "generator": generator,
            "output_type": "pt",
        }
        references = (conditions or {}).get("reference")
        if not references:
            return pipe(prompt=prompts, **settings).images  # (N, C, H, W) in [0, 1]
        import torch

        if len(references) != len(prompts):
            raise ValueError(
                f"field 'trainer.validation.conditions.reference': give one image per prompt "
                f"({len(prompts)}), or none."
            )
        return torch.cat(
            [
                pipe(image=[reference], prompt=prompt, **settings).images
                for prompt, reference in zip(prompts, references, strict=True)
            ]
        )


__all__ = [
    "REFERENCE",
    "Flux2",
    "empirical_mu",
    "latent_ids",
    "normalise",
    "text_ids",
    "text_layers",
]
