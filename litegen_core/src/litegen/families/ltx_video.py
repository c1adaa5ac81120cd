"""LTX-Video text-to-video and first-frame image-to-video (``LTXPipeline``,
``LTXImageToVideoPipeline``, ``LTXVideoTransformer3DModel``).

Latents: the LTX VAE (``AutoencoderKLLTXVideo``) compresses 32x in space and 8x in time (clips
of ``8k + 1`` frames; the first frame is encoded alone), normalised as ``(z - latents_mean) *
scaling_factor / latents_std`` with the VAE's ``latents_mean``/``latents_std`` buffers (the
inverse of the pipeline's ``_denormalize_latents``); patch size 1, so the transformer's tokens
are the latent pixels, frame by frame (the pipeline's ``_pack_latents``). Conditions: the T5
prompt embeddings and their attention mask (padding tokens masked out of cross-attention). The
transformer takes timesteps in [0, 1000], one per sample or one per token, and computes its
rotary embedding from the latent frame count, height and width and the pipeline's
``rope_interpolation_scale`` (VAE time compression / frame rate, then the spatial compression
twice); LiteGen trains at the pipeline's default frame rate, 25. The scheduler shifts the
noise levels by the token count (``use_dynamic_shifting``), as the pipeline's
``calculate_shift`` does when it samples.

Image-to-video (:class:`LTXVideoI2V`, ``LTXImageToVideoPipeline``) is first-frame
conditioning, as that pipeline samples: the first latent frame is the clean latents of the
first frame (the ``image`` media condition; the clip's own frame 0 when the media folder gives
none, which the VAE encodes alone, so the two agree), its tokens take timestep 0, and the loss
covers the other frames' tokens only. It trains on clips of at least 9 frames (two latent
frames). The published checkpoint (Lightricks/LTX-Video) does both, but its ``model_index.json``
names ``LTXPipeline``, and LiteGen picks the family by that name: to train image-to-video, point
``finetune.pipeline`` at a copy saved as ``LTXImageToVideoPipeline`` (``LTXImageToVideoPipeline
.from_pretrained(folder).save_pretrained(copy)``, or that one field of ``model_index.json``
edited). Validation samples take one first frame per prompt (``trainer.validation.conditions
.image``).

Sequence parallelism splits the packed tokens, their rotary embedding and a per-token timestep
at the model's input, and gathers ``proj_out``; the text stays whole.

Original checkpoint names (Lightricks' ``ltx-video`` releases, what ComfyUI reads): the same as
diffusers' except ``patchify_proj`` (``proj_in``), ``adaln_single`` (``time_embed``) and the
q/k norms ``q_norm``/``k_norm`` (``norm_q``/``norm_k``). diffusers 0.42.1 loads an original
(``diffusion_model.``-prefixed) LoRA by stripping the prefix and renaming nothing, so it reads
the adapters of the blocks (attention, feed-forward), ``caption_projection`` and ``proj_out``;
adapters of ``patchify_proj`` or ``adaln_single`` in an original-format LoRA are read by ComfyUI
but not by diffusers' ``load_lora_weights`` (use the diffusers-format file there).

The rotary embedding's time scale assumes the pipeline's default 25 frames per second: clips of
another rate (after ``finetune.data.frame_stride``) train at that scale all the same.

Example::

    from litegen.families.ltx_video import LTXVideo, LTXVideoI2V

    pipe = LTXVideo.tiny_pipeline()     # an LTXPipeline at LTXVideo.tiny_config, random weights
    i2v = LTXVideoI2V.tiny_pipeline()   # an LTXImageToVideoPipeline of the same components
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

    from litegen.objectives import FlowMatching
    from litegen.parallel.sequence.sequence_plan import SequencePlan

FRAME_RATE = 25  # the pipelines' default frame_rate: the time scale of the rotary embedding

# LTX-Video (LTXVideoTransformer3DModel) as Lightricks' checkpoints name it: diffusers'
# names but for the patch embedding, the timestep embedding and the q/k norms
# (single_file_utils.convert_ltx_transformer_checkpoint_to_diffusers renames the same).
_SAME = (
    "caption_projection.linear_1",
    "caption_projection.linear_2",
    "proj_out",
    *(
        f"transformer_blocks.{{i}}.{attn}.{proj}"
        for attn in ("attn1", "attn2")
        for proj in ("to_q", "to_k", "to_v", "to_out.0")
    ),
    "transformer_blocks.{i}.ff.net.0.proj",
    "transformer_blocks.{i}.ff.net.2",
)
_MODULES = {
    "patchify_proj": ("proj_in",),
    "adaln_single.emb.timestep_embedder.linear_1": ("time_embed.emb.timestep_embedder.linear_1",),
    "adaln_single.emb.timestep_embedder.linear_2": ("time_embed.emb.timestep_embedder.linear_2",),
    "adaln_single.linear": ("time_embed.linear",),
    **{name: (name,) for name in _SAME},
}
ORIGINAL_KEYS = KeyMap(
    modules=_MODULES,
    tensors={
        "scale_shift_table": "scale_shift_table",
        "transformer_blocks.{i}.scale_shift_table": "transformer_blocks.{i}.scale_shift_table",
        **{
            f"transformer_blocks.{{i}}.{attn}.{o}_norm.weight": f"transformer_blocks.{{i}}.{attn}.norm_{o}.weight"
            for attn in ("attn1", "attn2")
            for o in ("q", "k")
        },
    },
    # diffusers' LTX LoRA loader refuses any key without "lora" in it, so no alpha anywhere:
    # the scale goes into the up matrices (ComfyUI reads a missing alpha as scale 1).
    scale_in_up=tuple(_MODULES),
)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, H, W) latents as (B, F * H * W, C) tokens (patch size 1), as the pipeline's
    ``_pack_latents``."""
    return latents.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack`."""
    b, _, c = tokens.shape
    return tokens.transpose(1, 2).reshape(b, c, frames, height, width)


class LTXVideo(Family):
    """LTX-Video: T5 embeddings with their mask, 32x/8x latents as tokens, resolution shift;
    first-frame image-to-video by per-token timesteps."""

    name = "ltx_video"
    pipeline_class = "LTXPipeline"
    transformer_class = "LTXVideoTransformer3DModel"
    original_keys = ORIGINAL_KEYS
    frozen = ("vae", "text_encoder")
    latent = LatentRules(
        spatial_compression=32,
        patch_size=1,
        normalisation="(z - latents_mean) * scaling_factor / latents_std, the VAE's buffers",
        temporal_compression=8,
    )
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": "the T5 encoder's last hidden state, padded to the tokenizer length (at most 512)",
        "prompt_attention_mask": "the T5 tokens' mask: 1 for the caption, 0 for the padding",
    }
    reference_config: ClassVar[dict[str, Any]] = {  # Lightricks/LTX-Video (0.9)/transformer
        "in_channels": 128,
        "out_channels": 128,
        "patch_size": 1,
        "patch_size_t": 1,
        "num_attention_heads": 32,
        "attention_head_dim": 64,
        "cross_attention_dim": 2048,
        "num_layers": 28,
        "qk_norm": "rms_norm_across_heads",
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
        "caption_channels": 4096,
        "attention_bias": True,
        "attention_out_bias": True,
    }
    tiny_config: ClassVar[dict[str, Any]] = {  # two heads of 16, two blocks
        "in_channels": 4,
        "out_channels": 4,
        "patch_size": 1,
        "patch_size_t": 1,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "cross_attention_dim": 32,
        "num_layers": 2,
        "caption_channels": 32,
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """An ``LTXPipeline``: a tiny T5, an LTX VAE (32x in space, 8x in time, as the
        published one) and transformer; the published scheduler's dynamic shift at tiny
        token counts."""
        import torch
        from diffusers import (
            AutoencoderKLLTXVideo,
            FlowMatchEulerDiscreteScheduler,
            LTXPipeline,
            LTXVideoTransformer3DModel,
        )

        from litegen.families.tiny_text import tiny_t5_encoder, tiny_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_tokenizer(32, bos=False)
        vae = AutoencoderKLLTXVideo(  # patches of 4, then 3 space-time halvings: 32x, 8x
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True, False),
            decoder_spatio_temporal_scaling=(True, True, True, False),
            decoder_inject_noise=(False,) * 5,
            upsample_residual=(False,) * 4,
            upsample_factor=(1,) * 4,
        )
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3]))  # as a real VAE's: not 0/1
        vae.latents_std.copy_(torch.tensor([0.5, 2.0, 1.0, 1.5]))
        scheduler = FlowMatchEulerDiscreteScheduler(  # Lightricks/LTX-Video's, at tiny sizes
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.95,
            max_shift=2.05,
            base_image_seq_len=4,
            max_image_seq_len=64,
            shift_terminal=0.1,
        )
        return LTXPipeline(
            scheduler=scheduler,
            vae=vae,
            # eval, as from_pretrained loads it: T5's dropout would make the encoding random
            text_encoder=tiny_t5_encoder(len(tokenizer), umt5=False).eval(),
            tokenizer=tokenizer,
            transformer=LTXVideoTransformer3DModel(**cls.tiny_config),
        )

    @classmethod
    def sequence_plan(cls, model: torch.nn.Module) -> SequencePlan:
        """The packed input (B, S, C), its rotary embedding (cos, sin: (B, S, D) each) and a
        per-token timestep (B, S) split; ``proj_out`` gathered; only ``attn1`` is
        self-attention (``attn2`` attends to the whole text)."""
        from litegen.parallel.sequence.sequence_plan import SequencePlan, Split

        return SequencePlan(
            split_inputs={"": {"hidden_states": 1, "timestep": Split(1, ndim=2)}},
            split_outputs={"rope": {0: 1, 1: 1}},
            gather_outputs={"proj_out": 1},
            attention={"transformer_blocks.*.attn1": "self"},
        )

    # -- data -------------------------------------------------------------------------------
    def temporal_compression(self, vae_config: dict[str, Any]) -> int:
        if vae_config.get("temporal_compression_ratio"):
            return int(vae_config["temporal_compression_ratio"])
        scaling = vae_config.get("spatio_temporal_scaling", (True, True, True, False))
        return vae_config.get("patch_size_t", 1) * 2 ** sum(scaling)

    def encode_latents(self, pipe, pixels, micro_batch_size):
        from litegen.data.vae_encode import vae_encode

        if pixels.dim() == 4:  # images (max_frames=1): one-frame videos
            pixels = pixels.unsqueeze(2)
        vae = pipe.vae
        latents = vae_encode(
            vae, pixels, micro_batch_size=micro_batch_size, sample=False, scale=False
        )
        return normalise(latents, vae)

    def encode_text(self, pipe, captions):
        prompt_embeds, mask, _, _ = pipe.encode_prompt(
            captions,
            do_classifier_free_guidance=False,
            max_sequence_length=max_length(pipe.tokenizer),
            device=pipe.device,
        )
        return {"prompt_embeds": prompt_embeds, "prompt_attention_mask": mask.float()}

    # -- training ---------------------------------------------------------------------------
    def predict(self, model, noisy, sigmas, batch):
        """``sigmas``: one per sample (B,), or one per latent pixel (B, F, H, W) for
        per-token timesteps (first-frame conditioning)."""
        b, _, f, h, w = noisy.shape
        dtype = model_dtype(model)
        mask = batch.get("prompt_attention_mask")
        timestep = sigmas.reshape(b, -1) if sigmas.dim() > 1 else sigmas
        prediction = model(
            hidden_states=pack(noisy).to(dtype),
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            timestep=timestep * 1000,  # the scheduler's num_train_timesteps
            encoder_attention_mask=None if mask is None else mask.to(dtype),
            num_frames=f,
            height=h,
            width=w,
            rope_interpolation_scale=rope_interpolation_scale(self.latent),
            return_dict=False,
        )[0]
        return unpack(prediction, f, h, w)

    # -- sampling ---------------------------------------------------------------------------
    def sample(self, pipe, prompts, validation, generator, conditions=None):
        frames = pipe(
            prompt=prompts,
            **pipeline_settings(validation, num_frames=validation.frames),
            max_sequence_length=max_length(pipe.tokenizer),
            generator=generator,
            output_type="pt",
        ).frames  # (N, T, C, H, W) in [0, 1]
        return frames.transpose(1, 2)


class LTXVideoI2V(LTXVideo):
    """LTX-Video image-to-video: the same transformer, its first latent frame the clean
    latents of a first frame (the ``image`` condition; the clip's frame 0 by default) at
    timestep 0, the loss on the other frames."""

    name = "ltx_video_i2v"
    pipeline_class = "LTXImageToVideoPipeline"
    conditions: ClassVar[dict[str, str]] = {
        **LTXVideo.conditions,
        "first_frame_latents": "the VAE latents of the first frame (one latent frame), "
        "normalised as the clip's",
    }
    media_conditions: ClassVar[dict[str, MediaCondition]] = {
        "image": MediaCondition(
            "image", "the first frame the video starts from", default="first_frame"
        )
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """An ``LTXImageToVideoPipeline`` of the text-to-video tiny pipeline's components."""
        from diffusers import LTXImageToVideoPipeline

        return LTXImageToVideoPipeline(**LTXVideo.tiny_pipeline(seed).components)

    def encode_condition(self, pipe, name, pixels, clip, micro_batch_size):
        if name != "image":
            return super().encode_condition(pipe, name, pixels, clip, micro_batch_size)
        # The VAE encodes a clip's first frame alone: an image's latents are that frame's.
        latents = self.encode_latents(pipe, pixels, micro_batch_size)
        return {"first_frame_latents": latents}

    def loss(
        self, model: Any, batch: dict[str, torch.Tensor], objective: FlowMatching
    ) -> torch.Tensor:
        """The flow-matching loss of the frames after the first, the first latent frame
        clean at timestep 0 (the pipeline's ``t * (1 - conditioning_mask)``)."""
        import torch

        x0 = batch["latents"].float()
        if x0.shape[2] < 2:
            raise ValueError(
                f"{self.pipeline_class} trains on clips of at least "
                f"{self.latent.temporal_compression + 1} frames (two latent frames); this batch "
                "has one (an image, or finetune.data.max_frames too small): leave images out "
                "of the media folder and raise finetune.data.max_frames."
            )
        first = batch["first_frame_latents"].to(x0)
        noise = torch.randn_like(x0)
        shift = self.shift_for(self.seq_len(x0))
        sigmas = objective.sample_sigmas(x0.shape[0], device=x0.device, shift=shift)
        noisy = objective.add_noise(x0, noise, sigmas)
        noisy = torch.cat([first, noisy[:, :, 1:]], dim=2)
        per_token = sigmas.view(-1, 1, 1, 1).expand(-1, *x0.shape[2:]).clone()
        per_token[:, 0] = 0.0  # the conditioning frame
        prediction = self.predict(model, noisy, per_token, batch)
        return objective.loss(prediction[:, :, 1:], x0[:, :, 1:], noise[:, :, 1:], sigmas)

    def sample(self, pipe, prompts, validation, generator, conditions=None):
        """Samples from a first frame per prompt (``conditions``'s ``image``, a
        ``PIL.Image`` each), in one pipeline call."""
        images = self.inputs_per_prompt(conditions, "image", prompts)
        frames = pipe(
            image=list(images),
            prompt=prompts,
            **pipeline_settings(validation, num_frames=validation.frames),
            max_sequence_length=max_length(pipe.tokenizer),
            generator=generator,
            output_type="pt",
        ).frames
        return frames.transpose(1, 2)


def normalise(latents: torch.Tensor, vae: Any) -> torch.Tensor:
    """``(z - latents_mean) * scaling_factor / latents_std`` per channel, as the pipelines'
    ``_normalize_latents`` (the inverse of their decode)."""
    shape = (1, -1, 1, 1, 1)
    mean = vae.latents_mean.view(shape).to(latents)
    std = vae.latents_std.view(shape).to(latents)
    return (latents - mean) * vae.config.scaling_factor / std


def rope_interpolation_scale(latent: LatentRules) -> tuple[float, float, float]:
    """The pipelines' ``rope_interpolation_scale`` at :data:`FRAME_RATE`."""
    time = latent.temporal_compression or 1
    return (time / FRAME_RATE, latent.spatial_compression, latent.spatial_compression)


__all__ = [
    "FRAME_RATE",
    "ORIGINAL_KEYS",
    "LTXVideo",
    "LTXVideoI2V",
    "normalise",
    "pack",
    "unpack",
]
