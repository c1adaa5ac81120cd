"""Wan 2.1 text-to-video (``WanPipeline``) and image-to-video (``WanImageToVideoPipeline``),
one ``WanTransformer3DModel`` each.

Latents: the Wan VAE compresses 8x in space and 4x in time (clips of ``4k + 1`` frames; one
frame is an image), normalised by the VAE config's ``latents_mean`` and ``latents_std``;
patches of 1x2x2. Condition: the UMT5 prompt embeddings. The transformer takes timesteps in
[0, 1000] and computes its rotary embedding itself. Sequence parallelism splits the video
tokens at the first block and their rotary embedding, and gathers ``proj_out``.

Image-to-video (:class:`WanI2V`) takes a first frame (the ``image`` media condition; the clip's
own frame 0 when the media folder gives none): its CLIP vision embedding (the image encoder's
penultimate hidden states, what the transformer's ``image_embedder`` and the cross-attention's
``add_k_proj``/``add_v_proj`` read), and the pipeline's ``condition`` on channels beside the
noisy latents: a first-frame mask (one channel per frame the VAE folds into a latent frame,
ones at latent frame 0) then the VAE latents of the first frame followed by black (zero)
frames. The first-and-last-frame model (``last_image``, ``pos_embed_seq_len``) and Wan 2.2's
I2V (no image encoder) are not trained here. diffusers 0.42.1's ``WanImageToVideoPipeline``
cleans prompts with ftfy whether it is installed or not: prompts are encoded through
``WanPipeline``'s own UMT5 path (ftfy when installed, as there) and handed to it as embeddings.

Example::

    from litegen.families.wan import Wan, WanI2V

    pipe = Wan.tiny_pipeline()     # a WanPipeline at Wan.tiny_config, random weights
    i2v = WanI2V.tiny_pipeline()   # a WanImageToVideoPipeline with a tiny CLIP image encoder
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from litegen.families.base import (
    Family,
    LatentRules,
    MediaCondition,
    max_length,
    model_dtype,
    pipeline_settings,
)
from litegen.model_keys.key_map import KeyMap

if TYPE_CHECKING:
    import torch

    from litegen.parallel.sequence.sequence_plan import SequencePlan


# Wan 2.1 / 2.2 (WanTransformer3DModel) as Wan-AI's checkpoints name it; q, k and v stay
# separate there. The image-to-video models add k_img/v_img/norm_k_img and the image embedder.
# diffusers' converter takes alpha inside the blocks only and refuses it elsewhere.
ORIGINAL_KEYS = KeyMap(
    modules={
        "patch_embedding": ("patch_embedding",),
        "time_embedding.0": ("condition_embedder.time_embedder.linear_1",),
        "time_embedding.2": ("condition_embedder.time_embedder.linear_2",),
        "time_projection.1": ("condition_embedder.time_proj",),
        "text_embedding.0": ("condition_embedder.text_embedder.linear_1",),
        "text_embedding.2": ("condition_embedder.text_embedder.linear_2",),
        "img_emb.proj.0": ("condition_embedder.image_embedder.norm1",),
        "img_emb.proj.1": ("condition_embedder.image_embedder.ff.net.0.proj",),
        "img_emb.proj.3": ("condition_embedder.image_embedder.ff.net.2",),
        "img_emb.proj.4": ("condition_embedder.image_embedder.norm2",),
        "blocks.{i}.self_attn.q": ("blocks.{i}.attn1.to_q",),
        "blocks.{i}.self_attn.k": ("blocks.{i}.attn1.to_k",),
        "blocks.{i}.self_attn.v": ("blocks.{i}.attn1.to_v",),
        "blocks.{i}.self_attn.o": ("blocks.{i}.attn1.to_out.0",),
        "blocks.{i}.self_attn.norm_q": ("blocks.{i}.attn1.norm_q",),
        "blocks.{i}.self_attn.norm_k": ("blocks.{i}.attn1.norm_k",),
        "blocks.{i}.cross_attn.q": ("blocks.{i}.attn2.to_q",),
        "blocks.{i}.cross_attn.k": ("blocks.{i}.attn2.to_k",),
        "blocks.{i}.cross_attn.v": ("blocks.{i}.attn2.to_v",),
        "blocks.{i}.cross_attn.o": ("blocks.{i}.attn2.to_out.0",),
        "blocks.{i}.cross_attn.norm_q": ("blocks.{i}.attn2.norm_q",),
        "blocks.{i}.cross_attn.norm_k": ("blocks.{i}.attn2.norm_k",),
        "blocks.{i}.cross_attn.k_img": ("blocks.{i}.attn2.add_k_proj",),
        "blocks.{i}.cross_attn.v_img": ("blocks.{i}.attn2.add_v_proj",),
        "blocks.{i}.cross_attn.norm_k_img": ("blocks.{i}.attn2.norm_added_k",),
        "blocks.{i}.norm3": ("blocks.{i}.norm2",),  # the cross-attention norm
        "blocks.{i}.ffn.0": ("blocks.{i}.ffn.net.0.proj",),
        "blocks.{i}.ffn.2": ("blocks.{i}.ffn.net.2",),
        "head.head": ("proj_out",),
    },
    tensors={
        "head.modulation": "scale_shift_table",
        "blocks.{i}.modulation": "blocks.{i}.scale_shift_table",
        "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed",  # first-last frame
    },
    scale_in_up=(
        "patch_embedding",
        "time_embedding.0",
        "time_embedding.2",
        "time_projection.1",
        "text_embedding.0",
        "text_embedding.2",
        "img_emb.proj.1",
        "img_emb.proj.3",
        "head.head",
    ),
)


class Wan(Family):
    """Wan 2.1 text-to-video: UMT5 embeddings, latents normalised by the VAE's mean and std."""

    name = "wan"
    pipeline_class = "WanPipeline"
    transformer_class = "WanTransformer3DModel"
    original_keys = ORIGINAL_KEYS
    frozen = ("vae", "text_encoder")
    latent = LatentRules(
        spatial_compression=8,
        patch_size=2,
        normalisation="(z - latents_mean) / latents_std, the VAE config's per-channel values",
        temporal_compression=4,
    )
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": "the UMT5 encoder's last hidden state, padded to the tokenizer length (at most 512)"
    }
    reference_config: ClassVar[dict[str, Any]] = {  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers/transformer
        "patch_size": (1, 2, 2),
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 8960,
        "num_layers": 30,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }
    tiny_config: ClassVar[
        dict[str, Any]
    ] = {  # two heads of 16, two blocks: a real stack for FSDP units and checkpointing
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "in_channels": 4,
        "out_channels": 4,
        "text_dim": 32,
        "freq_dim": 32,
        "ffn_dim": 64,
        "num_layers": 2,
        "rope_max_seq_len": 32,
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``WanPipeline``: a tiny UMT5, a Wan VAE (8x in space, 4x in time) and transformer."""
        import torch
        from diffusers import (
            AutoencoderKLWan,
            FlowMatchEulerDiscreteScheduler,
            WanPipeline,
            WanTransformer3DModel,
        )

        from litegen.families.tiny_text import tiny_t5_encoder, tiny_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_tokenizer(32, bos=False)
        transformer = WanTransformer3DModel(**cls.tiny_config)
        vae = AutoencoderKLWan(  # 8x in space, 4x in time, as Wan 2.1's
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
        return WanPipeline(
            tokenizer=tokenizer,
            text_encoder=tiny_t5_encoder(len(tokenizer), umt5=True),
            transformer=transformer,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        )

    @classmethod
    def sequence_plan(cls, model: torch.nn.Module) -> SequencePlan:
        """Rotary embedding (1, S, 1, D) and block input split, ``proj_out`` gathered; a
        per-token timestep (B, S) is split too (Wan 2.2 TI2V)."""
        from litegen.parallel.sequence.sequence_plan import SequencePlan, Split

        return SequencePlan(
            split_inputs={"": {"timestep": Split(1, ndim=2)}, "blocks.0": {"hidden_states": 1}},
            split_outputs={"rope": {0: 1, 1: 1}},
            gather_outputs={"proj_out": 1},
            attention={"blocks.*.attn1": "self"},  # attn2 is cross-attention to the text
        )

    def temporal_compression(self, vae_config: dict[str, Any]) -> int:
        return 2 ** sum(vae_config.get("temperal_downsample", [False, True, True]))

    def encode_latents(self, pipe, pixels, micro_batch_size):
        import torch

        from litegen.data.vae_encode import vae_encode

        if pixels.dim() == 4:  # images (max_frames=1): one-frame videos
            pixels = pixels.unsqueeze(2)
        vae = pipe.vae
        latents = vae_encode(
            vae, pixels, micro_batch_size=micro_batch_size, sample=False, scale=False
        )
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
        return (latents - mean) / std

    def encode_text(self, pipe, captions):
        prompt_embeds, _ = pipe.encode_prompt(
            captions,
            do_classifier_free_guidance=False,
            max_sequence_length=max_length(pipe.tokenizer),
            device=pipe.device,
        )
        return {"prompt_embeds": prompt_embeds}

    def predict(self, model, noisy, sigmas, batch):
        dtype = model_dtype(model)
        return model(
            hidden_states=noisy.to(dtype),
            timestep=sigmas * 1000,  # the scheduler's num_train_timesteps
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def sample(self, pipe, prompts, validation, generator, conditions=None):
        frames = pipe(
            prompt=prompts,
            **pipeline_settings(validation, num_frames=validation.frames),
            max_sequence_length=max_length(pipe.tokenizer),
            generator=generator,
            output_type="pt",
        ).frames  # (N, T, C, H, W) in [0, 1]
        return frames.transpose(1, 2)


# The I2V transformer splits its cross-attention context into image and text tokens by counting
# 512 text tokens from the end: the prompt embeddings always have 512 rows, whatever the
# tokenizer's length.
I2V_TEXT_TOKENS = 512


class WanI2V(Wan):
    """Wan 2.1 image-to-video: the T2V forward with a first frame's CLIP embedding and its
    masked latents on channels (the ``image`` condition; the clip's frame 0 by default)."""

    name = "wan_i2v"
    pipeline_class = "WanImageToVideoPipeline"
    frozen = ("vae", "text_encoder", "image_encoder")
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": "the UMT5 encoder's last hidden state, padded to 512 tokens",
        "image_embeds": "the CLIP vision encoder's penultimate hidden states of the first frame",
        "first_frame": "the first-frame mask (VAE time-compression channels, ones at latent "
        "frame 0) then the VAE latents of the first frame followed by zero frames",
    }
    media_conditions: ClassVar[dict[str, MediaCondition]] = {
        "image": MediaCondition(
            "image", "the first frame the video starts from", default="first_frame"
        )
    }
    reference_config: ClassVar[dict[str, Any]] = {  # Wan-AI/Wan2.1-I2V-14B-480P-Diffusers
        **Wan.reference_config,
        "num_attention_heads": 40,
        "in_channels": 36,  # 16 noisy + 4 mask + 16 first-frame latents
        "ffn_dim": 13824,
        "num_layers": 40,
        "image_dim": 1280,
        "added_kv_proj_dim": 5120,
    }
    tiny_config: ClassVar[dict[str, Any]] = {
        **Wan.tiny_config,
        "in_channels": 12,  # 4 noisy + 4 mask + 4 first-frame latents
        "image_dim": 16,  # the tiny CLIP's hidden size
        "added_kv_proj_dim": 32,  # the transformer's width, as in the published model
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``WanImageToVideoPipeline``: the T2V parts, a tiny CLIP vision encoder (32-pixel
        crops, 16 wide) and its image processor (Pillow backend: no torchvision needed)."""
        import torch
        from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
        from transformers import CLIPVisionConfig, CLIPVisionModel
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        t2v = Wan.tiny_pipeline(seed)
        torch.manual_seed(seed + 1)
        image_encoder = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            )
        )
        processor = CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        return WanImageToVideoPipeline(
            tokenizer=t2v.tokenizer,
            text_encoder=t2v.text_encoder,
            vae=t2v.vae,
            scheduler=t2v.scheduler,
            image_processor=processor,
            image_encoder=image_encoder,
            transformer=WanTransformer3DModel(**cls.tiny_config),
        )

    def encode_text(self, pipe, captions):
        return {"prompt_embeds": _umt5_embeds(pipe, captions)}

    def encode_condition(self, pipe, name, pixels, clip, micro_batch_size):
        import torch

        if name != "image":
            return super().encode_condition(pipe, name, pixels, clip, micro_batch_size)
        images = [_to_pil(frame) for frame in pixels]
        image_embeds = pipe.encode_image(images, device=pipe.device)
        frames = clip.shape[2] if clip.dim() == 5 else 1
        black = pixels.new_zeros(pixels.shape[0], pixels.shape[1], frames - 1, *pixels.shape[2:])
        video = torch.cat([pixels.unsqueeze(2), black], dim=2)
        latents = self.encode_latents(pipe, video, micro_batch_size)
        mask = torch.zeros_like(latents[:, :1]).repeat(1, pipe.vae_scale_factor_temporal, 1, 1, 1)
        mask[:, :, 0] = 1  # the latent frame of the given first frame
        return {"image_embeds": image_embeds, "first_frame": torch.cat([mask, latents], dim=1)}

    def predict(self, model, noisy, sigmas, batch):
        import torch

        dtype = model_dtype(model)
        hidden = torch.cat([noisy, batch["first_frame"].to(noisy)], dim=1)
        return model(
            hidden_states=hidden.to(dtype),
            timestep=sigmas * 1000,
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            encoder_hidden_states_image=batch["image_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def sample(self, pipe, prompts, validation, generator, conditions=None):
        """One pipeline call per prompt, each from its own first frame (``conditions``'s
        ``image``, a ``PIL.Image`` per prompt)."""
        import torch

        images = self.inputs_per_prompt(conditions, "image", prompts)
        empty = _umt5_embeds(pipe, [""])  # the pipeline's default negative prompt
        videos = [
            pipe(
                image=image,
                prompt_embeds=_umt5_embeds(pipe, [prompt]),
                negative_prompt_embeds=empty,
                **pipeline_settings(validation, num_frames=validation.frames),
                generator=generator,
                output_type="pt",
            ).frames[0]  # (T, C, H, W) in [0, 1]
            for prompt, image in zip(prompts, images, strict=True)
        ]
        return torch.stack(videos).transpose(1, 2)


def _umt5_embeds(pipe: Any, prompts: list[str]) -> torch.Tensor:
    """The prompts' UMT5 embeddings as ``WanPipeline`` computes them, padded to
    :data:`I2V_TEXT_TOKENS`, on ``pipe``'s text encoder."""
    from diffusers import WanPipeline

    return WanPipeline._get_t5_prompt_embeds(
        pipe, prompts, max_sequence_length=I2V_TEXT_TOKENS, device=pipe.device
    )


def _to_pil(pixels: torch.Tensor) -> Any:
    """An image ``(C, H, W)`` in [-1, 1] as the RGB ``PIL.Image`` a pipeline is given."""
    from PIL import Image

    array = pixels.float().add(1).mul(127.5).round().clamp(0, 255).byte()
    return Image.fromarray(array.permute(1, 2, 0).cpu().numpy())


__all__ = ["Wan", "WanI2V"]
