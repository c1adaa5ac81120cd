"""HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``, ``HunyuanVideo15Transformer3DModel``).

Latents: ``AutoencoderKLHunyuanVideo15`` compresses 16x in space and 4x in time (clips of
``4k + 1`` frames; one frame is an image), scaled by the VAE config's ``scaling_factor``;
patches of 1x1x1. Conditions: the Qwen2.5-VL text model's third-to-last hidden state over the
pipeline's chat template (its first ``prompt_template_encode_start_idx`` tokens, the system
message, dropped) with its mask, padded to the pipeline's 1000 tokens; and the ByT5 glyph
embeddings of the prompt's quoted text with their mask (zeros and an empty mask for a prompt
without quotes), 256 tokens. The training forward trims both to the batch's longest caption
(the transformer moves the valid tokens first and masks the rest, so the cut changes nothing).

The transformer takes timesteps in [0, 1000], the noisy latents with the image-to-video
channels beside them (the conditioning latents and their mask: zeros for text-to-video, as the
pipeline gives them) and vision embeddings (zeros for text-to-video: the transformer masks them
out; one zero token stands for the pipeline's 729, which changes nothing). Validation samples
use the pipeline's guider (classifier-free guidance at ``trainer.validation.guidance``).

Original format: Tencent's HunyuanVideo-1.5 module names (``double_blocks.{i}.img_attn_q``,
``txt_in.individual_token_refiner``, ``byt5_in``...), q, k, v separate in the double blocks
and fused in the token refiner's ``self_attn_qkv``; the final modulation is (shift, scale).
diffusers 0.42.1 reads neither form back (no LoRA converter, no ``load_lora_weights`` on the
pipeline, no ``from_single_file`` for this transformer): the map is checked against diffusers'
``scripts/convert_hunyuan_video1_5_to_diffusers.py`` (docs/families.md), and the
diffusers-format LoRA loads with the transformer's own ``load_lora_adapter``.

Limits: no sequence-parallel plan: the video tokens attend jointly with the reordered text
tokens, as in HunyuanVideo's built-in plan, so one is feasible (split the video tokens and
their rotary table, keep the text whole, gather ``proj_out``) but not written.

The tiny pipeline's tokenizer is trained offline with the system message, so the dropped
template is Qwen's 108 tokens exactly; its ByT5 tokenizer needs no vocabulary file.

Example::

    from litegen.families.hunyuan_video15 import HunyuanVideo15

    pipe = HunyuanVideo15.tiny_pipeline()  # a HunyuanVideo15Pipeline, random weights
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from litegen.families.base import Family, LatentRules, model_dtype
from litegen.model_keys.key_map import KeyMap

if TYPE_CHECKING:
    import torch


def trimmed(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``embeds`` and ``mask`` cut to the batch's longest run of valid tokens (at least one)."""
    length = max(1, int(mask.sum(dim=1).max()))
    return embeds[:, :length], mask[:, :length]


# HunyuanVideo15Transformer3DModel as Tencent's HunyuanVideo-1.5 checkpoints name it.
ORIGINAL_KEYS = KeyMap(
    modules={
        "img_in.proj": ("x_embedder.proj",),
        "time_in.mlp.0": ("time_embed.timestep_embedder.linear_1",),
        "time_in.mlp.2": ("time_embed.timestep_embedder.linear_2",),
        "time_r_in.mlp.0": ("time_embed.timestep_embedder_r.linear_1",),  # use_meanflow
        "time_r_in.mlp.2": ("time_embed.timestep_embedder_r.linear_2",),
        "cond_type_embedding": ("cond_type_embed",),
        "vision_in.proj.0": ("image_embedder.norm_in",),
        "vision_in.proj.1": ("image_embedder.linear_1",),
        "vision_in.proj.3": ("image_embedder.linear_2",),
        "vision_in.proj.4": ("image_embedder.norm_out",),
        "byt5_in.layernorm": ("context_embedder_2.norm",),
        "byt5_in.fc1": ("context_embedder_2.linear_1",),
        "byt5_in.fc2": ("context_embedder_2.linear_2",),
        "byt5_in.fc3": ("context_embedder_2.linear_3",),
        "txt_in.input_embedder": ("context_embedder.proj_in",),
        "txt_in.t_embedder.mlp.0": ("context_embedder.time_text_embed.timestep_embedder.linear_1",),
        "txt_in.t_embedder.mlp.2": ("context_embedder.time_text_embed.timestep_embedder.linear_2",),
        "txt_in.c_embedder.linear_1": ("context_embedder.time_text_embed.text_embedder.linear_1",),
        "txt_in.c_embedder.linear_2": ("context_embedder.time_text_embed.text_embedder.linear_2",),
        **{
            f"txt_in.individual_token_refiner.blocks.{{i}}.{original}": tuple(
                f"context_embedder.token_refiner.refiner_blocks.{{i}}.{module}"
                for module in modules
            )
            for original, modules in {
                "norm1": ("norm1",),
                "self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                "self_attn_proj": ("attn.to_out.0",),
                "norm2": ("norm2",),
                "mlp.fc1": ("ff.net.0.proj",),
                "mlp.fc2": ("ff.net.2",),
                "adaLN_modulation.1": ("norm_out.linear",),
            }.items()
        },
        **{
            f"double_blocks.{{i}}.{original}": (f"transformer_blocks.{{i}}.{module}",)
            for original, module in {
                "img_mod.linear": "norm1.linear",
                "txt_mod.linear": "norm1_context.linear",
                "img_attn_q": "attn.to_q",
                "img_attn_k": "attn.to_k",
                "img_attn_v": "attn.to_v",
                "img_attn_q_norm": "attn.norm_q",
                "img_attn_k_norm": "attn.norm_k",
                "img_attn_proj": "attn.to_out.0",
                "txt_attn_q": "attn.add_q_proj",
                "txt_attn_k": "attn.add_k_proj",
                "txt_attn_v": "attn.add_v_proj",
                "txt_attn_q_norm": "attn.norm_added_q",
                "txt_attn_k_norm": "attn.norm_added_k",
                "txt_attn_proj": "attn.to_add_out",
                "img_mlp.fc1": "ff.net.0.proj",
                "img_mlp.fc2": "ff.net.2",
                "txt_mlp.fc1": "ff_context.net.0.proj",
                "txt_mlp.fc2": "ff_context.net.2",
            }.items()
        },
        "final_layer.linear": ("proj_out",),
        # Tencent's final modulation is (shift, scale); diffusers' norm_out.linear (scale, shift).
        "final_layer.adaLN_modulation.1": ("norm_out.linear[1/2]", "norm_out.linear[0/2]"),
    },
)


class HunyuanVideo15(Family):
    """HunyuanVideo 1.5 text-to-video: Qwen2.5-VL and ByT5 glyph embeddings, 16x VAE."""

    name = "hunyuan_video15"
    pipeline_class = "HunyuanVideo15Pipeline"
    transformer_class = "HunyuanVideo15Transformer3DModel"
    original_keys = ORIGINAL_KEYS
    tiny_export_limits: ClassVar[dict[str, str]] = {
        "original_lora": "diffusers 0.42 has no HunyuanVideo 1.5 LoRA converter and its "
        "pipeline no load_lora_weights",
        "original_weights": "diffusers 0.42's from_single_file does not know "
        "HunyuanVideo15Transformer3DModel",
    }
    frozen = ("vae", "text_encoder", "text_encoder_2")
    latent = LatentRules(
        spatial_compression=16,
        patch_size=1,
        normalisation="z * scaling_factor, the VAE config's",
        temporal_compression=4,
    )
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": "Qwen2.5-VL's third-to-last hidden state after the chat template, "
        "padded to 1000 tokens",
        "prompt_embeds_mask": "1 for the caption's tokens, 0 for the padding",
        "prompt_embeds_2": "ByT5's last hidden state of the prompt's quoted text (zeros when "
        "there is none), 256 tokens",
        "prompt_embeds_mask_2": "1 for the glyph text's tokens, 0 for the padding",
    }
    reference_config: ClassVar[dict[str, Any]] = {  # hunyuanvideo-community 480p T2V
        "in_channels": 65,  # 32 noisy + 32 conditioning latents + 1 mask
        "out_channels": 32,
        "num_attention_heads": 16,
        "attention_head_dim": 128,
        "num_layers": 54,
        "num_refiner_layers": 2,
        "mlp_ratio": 4.0,
        "patch_size": 1,
        "patch_size_t": 1,
        "qk_norm": "rms_norm",
        "text_embed_dim": 3584,
        "text_embed_2_dim": 1472,
        "image_embed_dim": 1152,
        "rope_theta": 256.0,
        "rope_axes_dim": (16, 56, 56),
        "target_size": 640,
        "task_type": "t2v",
    }
    tiny_config: ClassVar[dict[str, Any]] = {  # two blocks: FSDP units and checkpointing
        "in_channels": 9,  # 4 noisy + 4 conditioning latents + 1 mask
        "out_channels": 4,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "num_layers": 2,
        "num_refiner_layers": 1,
        "mlp_ratio": 2.0,
        "text_embed_dim": 32,
        "text_embed_2_dim": 32,
        "image_embed_dim": 16,
        "rope_axes_dim": (4, 6, 6),
        "target_size": 32,
        "task_type": "t2v",
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``HunyuanVideo15Pipeline``: a two-layer Qwen2.5-VL text model, a one-layer ByT5,
        a HunyuanVideo 1.5 VAE (16x in space, 4x in time) and transformer."""
        import inspect

        import torch
        from diffusers import (
            AutoencoderKLHunyuanVideo15,
            ClassifierFreeGuidance,
            FlowMatchEulerDiscreteScheduler,
            HunyuanVideo15Pipeline,
            HunyuanVideo15Transformer3DModel,
        )
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

        from litegen.families.tiny_qwen import tiny_qwen_tokenizer
        from litegen.families.tiny_text import tiny_t5_encoder

        torch.manual_seed(seed)
        encode = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
        tokenizer = tiny_qwen_tokenizer(2048, (encode.parameters["system_message"].default,))
        text_encoder = Qwen2_5_VLTextModel(
            Qwen2_5_VLTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,  # the pipeline reads the third-to-last hidden state
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=2048,
                bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                },
            )
        ).eval()
        byt5 = ByT5Tokenizer()
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=4,
            block_out_channels=(8, 8, 16, 16, 16),
            layers_per_block=1,
            spatial_compression_ratio=16,
            temporal_compression_ratio=4,
            scaling_factor=0.8,
        )
        return HunyuanVideo15Pipeline(
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=HunyuanVideo15Transformer3DModel(**cls.tiny_config),
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
            text_encoder_2=tiny_t5_encoder(len(byt5), umt5=False).eval(),
            tokenizer_2=byt5,
            guider=ClassifierFreeGuidance(guidance_scale=6.0),
        )

    def temporal_compression(self, vae_config: dict[str, Any]) -> int:
        return int(vae_config.get("temporal_compression_ratio", 4))

    def encode_latents(self, pipe, pixels, micro_batch_size):
        from litegen.data.vae_encode import vae_encode

        if pixels.dim() == 4:  # images (max_frames=1): one-frame videos
            pixels = pixels.unsqueeze(2)
        # One clip per VAE call: diffusers 0.42.1's mid-block attention mask of this VAE
        # broadcasts over a batch of one only.
        latents = vae_encode(pipe.vae, pixels, micro_batch_size=1, sample=False, scale=False)
        return latents * pipe.vae.config.scaling_factor  # the pipeline's decode divides by it

    def encode_text(self, pipe, captions):
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(
            captions, device=pipe.device, batch_size=len(captions)
        )
        return {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask.long(),
            "prompt_embeds_2": embeds_2,
            "prompt_embeds_mask_2": mask_2.long(),
        }

    def predict(self, model, noisy, sigmas, batch):
        import torch

        from litegen.families.base import model_config
        from litegen.families.qwen_image import last_text_stream

        dtype = model_dtype(model)
        text, mask = trimmed(batch["prompt_embeds"], batch["prompt_embeds_mask"])
        glyphs, glyph_mask = trimmed(batch["prompt_embeds_2"], batch["prompt_embeds_mask_2"])
        b, c = noisy.shape[:2]
        # Text-to-video: the image-to-video conditioning latents and their mask are zeros.
        conditioning = noisy.new_zeros(b, c + 1, *noisy.shape[2:])
        vision = noisy.new_zeros(b, 1, model_config(model).image_embed_dim, dtype=dtype)
        with last_text_stream(model, text_output=1) as text_out:
            prediction = model(
                hidden_states=torch.cat([noisy, conditioning], dim=1).to(dtype),
                timestep=(sigmas * 1000).to(dtype),  # the scheduler's num_train_timesteps
                encoder_hidden_states=text.to(dtype),
                encoder_attention_mask=mask.to(dtype),
                encoder_hidden_states_2=glyphs.to(dtype),
                encoder_attention_mask_2=glyph_mask.to(dtype),
                image_embeds=vision,
                return_dict=False,
            )[0]
        return prediction + 0 * text_out[0].sum()  # see last_text_stream

    def sample(self, pipe, prompts, validation, generator, conditions=None):
        from diffusers import ClassifierFreeGuidance

        settings = {
            "height": validation.height,
            "width": validation.width,
            "num_inference_steps": validation.steps,
            "num_frames": validation.frames,
        }
        # The pipeline reads these from its transformer when built; one built without it
        # (the fine-tuning road loads the frozen parts alone) keeps the published defaults.
        config = pipe.transformer.config
        pipe.vision_states_dim, pipe.target_size = config.image_embed_dim, config.target_size
        guider = pipe.guider
        if validation.guidance is not None:  # the pipeline's guidance lives in its guider
            pipe.guider = ClassifierFreeGuidance(guidance_scale=validation.guidance)
        try:
            frames = pipe(
                prompt=prompts,
                **{name: value for name, value in settings.items() if value is not None},
                generator=generator,
                output_type="pt",
            ).frames  # (N, T, C, H, W) in [0, 1]
        finally:
            pipe.guider = guider
        return frames.transpose(1, 2)


__all__ = ["HunyuanVideo15"]
