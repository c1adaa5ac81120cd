"""Real diffusion transformers from diffusers, at their published size or tiny, with batches.

The table :data:`REAL_MODELS`: one :class:`~litegen_zoo.real_model_spec.RealModel` per
architecture, with the published config of its reference checkpoint, a tiny config of the same
class, the latent size each is used at, and the calls that make its conditions and run its
``forward`` (``real_model_inputs.py``). The architectures a model family trains (Wan, Flux, LTX-Video)
take their configs and their forward from :mod:`litegen.families`. ``RealModel``, ``Batch`` and ``LatentShape`` are
importable from here too.

Example:
    >>> spec = REAL_MODELS["flux"]
    >>> model = spec.build("tiny")
    >>> batch = spec.batch("tiny", batch_size=2, seed=0)
    >>> spec.loss(model, batch).backward()
    >>> spec.predict(model, batch).shape == batch["latents"].shape
    True
"""

from __future__ import annotations

from dataclasses import replace

from litegen.families.flux import Flux
from litegen.families.ltx_video import LTXVideo
from litegen.families.wan import Wan
from litegen_zoo.real_model_inputs import (
    Batch,
    LatentShape,
    cogvideox_conditions,
    cogvideox_run,
    dit_conditions,
    dit_run,
    flux_conditions,
    flux_run,
    hunyuan_conditions,
    hunyuan_run,
    ltx_conditions,
    ltx_run,
    pixart_conditions,
    pixart_run,
    sd3_conditions,
    sd3_run,
    wan_conditions,
    wan_run,
)
from litegen_zoo.real_model_spec import RealModel

__all__ = ["REAL_MODELS", "Batch", "LatentShape", "RealModel"]

# Tiny configs: 2 heads of 16 (hidden 32), two of each repeated block (so block detection and
# FSDP units see a real stack), a few latent pixels and text tokens.
_HEADS = {"num_attention_heads": 2, "attention_head_dim": 16}

REAL_MODELS: dict[str, RealModel] = {
    spec.name: spec
    for spec in (
        RealModel(
            name="dit",
            class_name="DiTTransformer2DModel",
            # facebook/DiT-XL-2-256
            reference={
                "num_attention_heads": 16,
                "attention_head_dim": 72,
                "in_channels": 4,
                "out_channels": 8,
                "num_layers": 28,
                "sample_size": 32,
                "patch_size": 2,
                "num_embeds_ada_norm": 1000,
                "norm_type": "ada_norm_zero",
                "norm_elementwise_affine": False,
            },
            tiny=_HEADS
            | {
                "in_channels": 4,
                "out_channels": 8,
                "num_layers": 2,
                "sample_size": 8,
                "patch_size": 2,
                "num_embeds_ada_norm": 10,
            },
            reference_shape=LatentShape(32, 32),
            tiny_shape=LatentShape(8, 8),
            latent_layout="bchw",
            conditions=dit_conditions,
            run=dit_run,
        ),
        RealModel(
            name="pixart",
            class_name="PixArtTransformer2DModel",
            # PixArt-alpha/PixArt-XL-2-512x512
            reference={
                "num_attention_heads": 16,
                "attention_head_dim": 72,
                "in_channels": 4,
                "out_channels": 8,
                "num_layers": 28,
                "cross_attention_dim": 1152,
                "caption_channels": 4096,
                "sample_size": 64,
                "patch_size": 2,
                "norm_type": "ada_norm_single",
                "norm_elementwise_affine": False,
                "norm_eps": 1e-6,
                "use_additional_conditions": False,
            },
            tiny=_HEADS
            | {
                "in_channels": 4,
                "out_channels": 8,
                "num_layers": 2,
                "cross_attention_dim": 32,
                "caption_channels": 16,
                "sample_size": 8,
                "patch_size": 2,
                "use_additional_conditions": False,
            },
            reference_shape=LatentShape(64, 64, text_tokens=120),
            tiny_shape=LatentShape(8, 8, text_tokens=6),
            latent_layout="bchw",
            conditions=pixart_conditions,
            run=pixart_run,
        ),
        RealModel(
            name="sd3",
            class_name="SD3Transformer2DModel",
            # stabilityai/stable-diffusion-3-medium-diffusers; 333 tokens = 77 CLIP + 256 T5
            reference={
                "sample_size": 128,
                "patch_size": 2,
                "in_channels": 16,
                "out_channels": 16,
                "num_layers": 24,
                "attention_head_dim": 64,
                "num_attention_heads": 24,
                "joint_attention_dim": 4096,
                "caption_projection_dim": 1536,
                "pooled_projection_dim": 2048,
                "pos_embed_max_size": 192,
            },
            tiny=_HEADS
            | {
                "sample_size": 8,
                "patch_size": 2,
                "in_channels": 4,
                "out_channels": 4,
                "num_layers": 2,
                "joint_attention_dim": 16,
                "caption_projection_dim": 32,
                "pooled_projection_dim": 16,
                "pos_embed_max_size": 8,
            },
            reference_shape=LatentShape(128, 128, text_tokens=333),
            tiny_shape=LatentShape(8, 8, text_tokens=6),
            latent_layout="bchw",
            conditions=sd3_conditions,
            run=sd3_run,
        ),
        RealModel(
            name="flux",
            class_name=Flux.transformer_class,
            reference=Flux.reference_config,  # black-forest-labs/FLUX.1-dev
            tiny=Flux.tiny_config | {"guidance_embeds": True},  # the guidance path too
            reference_shape=LatentShape(128, 128, text_tokens=512),
            tiny_shape=LatentShape(8, 8, text_tokens=6),
            latent_layout="bchw",
            conditions=flux_conditions,
            run=flux_run,
            latent_channels_per_input=1 / 4,
        ),
        RealModel(
            name="wan",
            class_name=Wan.transformer_class,
            reference=Wan.reference_config,  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers; 81 frames at 480x832
            tiny=Wan.tiny_config,
            reference_shape=LatentShape(60, 104, frames=21, text_tokens=512),
            tiny_shape=LatentShape(4, 4, frames=2, text_tokens=6),
            latent_layout="bcfhw",
            conditions=wan_conditions,
            run=wan_run,
        ),
        RealModel(
            name="cogvideox",
            class_name="CogVideoXTransformer3DModel",
            # THUDM/CogVideoX-2b; 49 frames at 480x720, text padded to max_text_seq_length
            reference={
                "num_attention_heads": 30,
                "attention_head_dim": 64,
                "in_channels": 16,
                "out_channels": 16,
                "time_embed_dim": 512,
                "text_embed_dim": 4096,
                "num_layers": 30,
                "sample_width": 90,
                "sample_height": 60,
                "sample_frames": 49,
                "patch_size": 2,
                "temporal_compression_ratio": 4,
                "max_text_seq_length": 226,
                "use_rotary_positional_embeddings": False,
            },
            tiny=_HEADS
            | {
                "in_channels": 4,
                "out_channels": 4,
                "time_embed_dim": 16,
                "text_embed_dim": 16,
                "num_layers": 2,
                "sample_width": 4,
                "sample_height": 4,
                "sample_frames": 5,  # 2 latent frames, before the VAE's 4x time compression
                "patch_size": 2,
                "max_text_seq_length": 6,
            },
            reference_shape=LatentShape(60, 90, frames=13, text_tokens=226),
            tiny_shape=LatentShape(4, 4, frames=2, text_tokens=6),
            latent_layout="bfchw",
            conditions=cogvideox_conditions,
            run=cogvideox_run,
        ),
        RealModel(
            name="hunyuan_video",
            class_name="HunyuanVideoTransformer3DModel",
            # hunyuanvideo-community/HunyuanVideo; 129 frames at 720x1280
            reference={
                "in_channels": 16,
                "out_channels": 16,
                "num_attention_heads": 24,
                "attention_head_dim": 128,
                "num_layers": 20,
                "num_single_layers": 40,
                "num_refiner_layers": 2,
                "mlp_ratio": 4.0,
                "patch_size": 2,
                "patch_size_t": 1,
                "qk_norm": "rms_norm",
                "guidance_embeds": True,
                "text_embed_dim": 4096,
                "pooled_projection_dim": 768,
                "rope_theta": 256.0,
                "rope_axes_dim": (16, 56, 56),
            },
            tiny=_HEADS
            | {
                "in_channels": 4,
                "out_channels": 4,
                "num_layers": 2,
                "num_single_layers": 2,
                "num_refiner_layers": 2,
                "mlp_ratio": 2.0,
                "patch_size": 2,
                "patch_size_t": 1,
                "guidance_embeds": True,
                "text_embed_dim": 16,
                "pooled_projection_dim": 16,
                "rope_axes_dim": (4, 6, 6),
            },
            reference_shape=LatentShape(90, 160, frames=33, text_tokens=256),
            tiny_shape=LatentShape(4, 4, frames=2, text_tokens=6),
            latent_layout="bcfhw",
            conditions=hunyuan_conditions,
            run=hunyuan_run,
        ),
        RealModel(
            name="ltx_video",
            class_name=LTXVideo.transformer_class,
            reference=LTXVideo.reference_config,  # Lightricks/LTX-Video (0.9); 161 frames at 512x704
            tiny=LTXVideo.tiny_config,
            reference_shape=LatentShape(16, 22, frames=21, text_tokens=128),
            tiny_shape=LatentShape(4, 4, frames=2, text_tokens=6),
            latent_layout="bcfhw",
            conditions=ltx_conditions,
            run=ltx_run,
        ),
    )
}

# Wan-AI/Wan2.1-T2V-14B-Diffusers: Wan's classes and inputs at 40 blocks of width 5120; its
# reference shape, 81 frames at 720x1280, is 75,600 tokens.
REAL_MODELS["wan_14b"] = replace(
    REAL_MODELS["wan"],
    name="wan_14b",
    reference=REAL_MODELS["wan"].reference
    | {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
    reference_shape=LatentShape(90, 160, frames=21, text_tokens=512),
)
