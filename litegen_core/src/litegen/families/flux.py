"""Flux.1 text-to-image (``FluxPipeline``, ``FluxTransformer2DModel``).

Latents: an ``AutoencoderKL`` compressing 8x, normalised as ``(z - shift_factor) *
scaling_factor``, then packed into 2x2 patches (the transformer's tokens). Conditions: the T5
prompt embeddings and CLIP's pooled embedding. The transformer takes the noise level itself as
its timestep, 3-axis position ids for its rotary embedding (zeros for the text, (0, row,
column) for the image), and, when guidance-distilled (FLUX.1-dev), a guidance scale: trained
at 1.0. The scheduler shifts the noise levels by the token count. Sequence parallelism: no plan
of its own; LiteGen reads diffusers' ``_cp_plan`` (image tokens and ids split, text whole).

Example::

    from litegen.families.flux import Flux

    pipe = Flux.tiny_pipeline()  # a FluxPipeline at Flux.tiny_config, random weights
"""

from __future__ import annotations

from typing import Any, ClassVar

from litegen.families.base import (
    Family,
    LatentRules,
    max_length,
    model_config,
    model_dtype,
    pipeline_settings,
)
from litegen.families.packing import image_ids, pack, unpack
from litegen.model_keys.key_map import KeyMap

# Flux.1 (FluxTransformer2DModel) as Black Forest Labs' checkpoints name it. diffusers reads
# LoRAs under this prefix only with lora_down/lora_up names (its sd-scripts converter);
# ComfyUI reads those names too.
ORIGINAL_KEYS = KeyMap(
    modules={
        "img_in": ("x_embedder",),
        "txt_in": ("context_embedder",),
        "time_in.in_layer": ("time_text_embed.timestep_embedder.linear_1",),
        "time_in.out_layer": ("time_text_embed.timestep_embedder.linear_2",),
        "guidance_in.in_layer": ("time_text_embed.guidance_embedder.linear_1",),
        "guidance_in.out_layer": ("time_text_embed.guidance_embedder.linear_2",),
        "vector_in.in_layer": ("time_text_embed.text_embedder.linear_1",),
        "vector_in.out_layer": ("time_text_embed.text_embedder.linear_2",),
        "double_blocks.{i}.img_mod.lin": ("transformer_blocks.{i}.norm1.linear",),
        "double_blocks.{i}.txt_mod.lin": ("transformer_blocks.{i}.norm1_context.linear",),
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
        "double_blocks.{i}.img_mlp.0": ("transformer_blocks.{i}.ff.net.0.proj",),
        "double_blocks.{i}.img_mlp.2": ("transformer_blocks.{i}.ff.net.2",),
        "double_blocks.{i}.txt_mlp.0": ("transformer_blocks.{i}.ff_context.net.0.proj",),
        "double_blocks.{i}.txt_mlp.2": ("transformer_blocks.{i}.ff_context.net.2",),
        "single_blocks.{i}.modulation.lin": ("single_transformer_blocks.{i}.norm.linear",),
        "single_blocks.{i}.linear1": (
            "single_transformer_blocks.{i}.attn.to_q",
            "single_transformer_blocks.{i}.attn.to_k",
            "single_transformer_blocks.{i}.attn.to_v",
            "single_transformer_blocks.{i}.proj_mlp",
        ),
        "single_blocks.{i}.linear2": ("single_transformer_blocks.{i}.proj_out",),
        "final_layer.linear": ("proj_out",),
        # BFL's final modulation is (shift, scale); diffusers' norm_out.linear (scale, shift).
        "final_layer.adaLN_modulation.1": ("norm_out.linear[1/2]", "norm_out.linear[0/2]"),
    },
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
    lora_names=("lora_down", "lora_up"),
)


class Flux(Family):
    """Flux.1 text-to-image: T5 + pooled CLIP embeddings, 2x2-packed latents, resolution shift."""

    name = "flux"
    pipeline_class = "FluxPipeline"
    transformer_class = "FluxTransformer2DModel"
    original_keys = ORIGINAL_KEYS
    frozen = ("vae", "text_encoder", "text_encoder_2")
    tiny_export_limits: ClassVar[dict[str, str]] = {
        "original_lora": "diffusers 0.42 splits single_blocks.N.linear1 (q, k, v and the MLP "
        "input fused) at Flux.1's widths only (3072 x 3 + 12288 rows), not the tiny model's",
        "original_weights": "diffusers 0.42's from_single_file splits single_blocks.N.linear1 "
        "at Flux.1's widths only (3072 x 3 + 12288 rows), not the tiny model's",
    }
    latent = LatentRules(
        spatial_compression=8,
        patch_size=2,
        normalisation="(z - shift_factor) * scaling_factor, then 2x2 patches packed as tokens",
    )
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": "the T5 encoder's last hidden state (tokenizer_2 length, at most 512)",
        "pooled": "CLIP's pooled output",
    }
    reference_config: ClassVar[dict[str, Any]] = {  # black-forest-labs/FLUX.1-dev/transformer
        "patch_size": 1,
        "in_channels": 64,
        "num_layers": 19,
        "num_single_layers": 38,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,
        "pooled_projection_dim": 768,
        "guidance_embeds": True,
        "axes_dims_rope": (16, 56, 56),
    }
    tiny_config: ClassVar[
        dict[str, Any]
    ] = {  # two of each block: repeated blocks for FSDP and checkpointing
        "patch_size": 1,
        "in_channels": 16,  # 4 latent channels in 2x2 patches
        "num_layers": 2,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "axes_dims_rope": (4, 6, 6),
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``FluxPipeline``: tiny CLIP and T5 encoders, an 8x ``AutoencoderKL``, Flux's MMDiT."""
        import torch
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            FluxPipeline,
            FluxTransformer2DModel,
        )

        from litegen.families.tiny_text import tiny_clip_encoder, tiny_t5_encoder, tiny_tokenizer

        torch.manual_seed(seed)
        clip_tokenizer, t5_tokenizer = tiny_tokenizer(77, bos=True), tiny_tokenizer(32, bos=False)
        clip = tiny_clip_encoder(len(clip_tokenizer))
        transformer = FluxTransformer2DModel(**cls.tiny_config)
        vae = AutoencoderKL(
            block_out_channels=(8, 8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=32,
            scaling_factor=0.5,
            shift_factor=0.1,
        )
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256
        )
        return FluxPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=clip,
            tokenizer=clip_tokenizer,
            text_encoder_2=tiny_t5_encoder(len(t5_tokenizer), umt5=False),
            tokenizer_2=t5_tokenizer,
            transformer=transformer,
        )

    def encode_latents(self, pipe, pixels, micro_batch_size):
        from litegen.data.vae_encode import vae_encode

        # (z - shift_factor) * scaling_factor, the inverse of the pipeline's decode.
        return vae_encode(pipe.vae, pixels, micro_batch_size=micro_batch_size, sample=False)

    def encode_text(self, pipe, captions):
        prompt_embeds, pooled, _ = pipe.encode_prompt(
            captions,
            prompt_2=None,
            max_sequence_length=max_length(pipe.tokenizer_2),
            device=pipe.device,
        )
        return {"prompt_embeds": prompt_embeds, "pooled": pooled}

    def predict(self, model, noisy, sigmas, batch):
        import torch

        b, _, h, w = noisy.shape
        dtype = model_dtype(model)
        text = batch["prompt_embeds"].to(dtype)
        guidance = None
        if model_config(model).guidance_embeds:  # guidance-distilled (FLUX.1-dev): 1.0 unless given
            guidance = batch.get("guidance", torch.ones(b, device=noisy.device))
        prediction = model(
            hidden_states=pack(noisy).to(dtype),
            timestep=sigmas.to(dtype),  # Flux takes timestep / 1000: the noise level itself
            guidance=guidance,
            pooled_projections=batch["pooled"].to(dtype),
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=noisy.device, dtype=dtype),
            img_ids=image_ids(h, w, noisy.device).to(dtype),
            return_dict=False,
        )[0]
        return unpack(prediction, h, w)

    def sample(self, pipe, prompts, validation, generator):
        return pipe(
            prompt=prompts,
            **pipeline_settings(validation),
            max_sequence_length=max_length(pipe.tokenizer_2),
            generator=generator,
            output_type="pt",
        ).images  # (N, C, H, W) in [0, 1]


__all__ = ["Flux"]
