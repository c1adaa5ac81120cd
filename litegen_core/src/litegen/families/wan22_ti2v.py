"""Wan 2.2 TI2V-5B: text-to-video, and image-to-video from the first frame (``WanPipeline``
with ``expand_timesteps``, ``WanTransformer3DModel``).

Latents: the Wan 2.2 VAE (``AutoencoderKLWan`` with ``is_residual``, ``patch_size`` 2, z_dim 48)
compresses 16x in space (a 2x2 pixel patchify, then 8x) and 4x in time (clips of ``4k + 1``
frames), normalised by the VAE config's ``latents_mean`` and ``latents_std`` as Wan 2.1's;
transformer patches of 1x2x2, so pixel sides are multiples of 32. Condition: the UMT5 prompt
embeddings. The transformer takes one timestep per token (``expand_timesteps``): with
image-to-video, the first latent frame (the image, encoded alone by the causal VAE) keeps
timestep 0 and stays clean, the other frames are noised, and the loss leaves the first frame
out, as diffusers' ``WanImageToVideoPipeline`` samples it (``expand_timesteps``). The media
condition ``image`` (optional: a ``<stem>.image.png`` companion or an ``image`` metadata column)
asks for that; its VAE latents, encoded alone, are the batch's ``first_frame``. A folder gives
an image for every file (image-to-video) or for none (text-to-video): samples of one batch are
alike. Validation samples take ``trainer.validation.conditions.image`` the same way.

Sequence parallelism: Wan's plan, which splits the per-token timesteps with the tokens.

Example::

    from litegen.families.wan22_ti2v import Wan22TI2V

    pipe = Wan22TI2V.tiny_pipeline()  # a WanPipeline with a tiny Wan 2.2 VAE, expand_timesteps
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from litegen.families.base import (
    LatentRules,
    MediaCondition,
    max_length,
    model_dtype,
    pipeline_settings,
)
from litegen.families.wan import Wan

if TYPE_CHECKING:
    import torch

    from litegen.objectives import FlowMatching

FIRST_FRAME = "first_frame"  # the batch entry: the first frame's latents (B, C, 1, h, w)


class Wan22TI2V(Wan):
    """Wan 2.2 TI2V-5B: the Wan 2.2 VAE (16x in space), per-token timesteps, first-frame I2V."""

    name = "wan22_ti2v"
    model_index_keys = ("expand_timesteps",)
    conditions: ClassVar[dict[str, str]] = {
        **Wan.conditions,
        FIRST_FRAME: "image-to-video: the VAE latents of the first frame alone (one latent frame)",
    }
    media_conditions: ClassVar[dict[str, MediaCondition]] = {
        "image": MediaCondition(
            "image",
            "the first frame, kept clean at timestep 0 (optional: without it, text-to-video)",
            optional=True,
        )
    }
    latent = LatentRules(
        spatial_compression=16,
        patch_size=2,
        normalisation="(z - latents_mean) / latents_std, the VAE config's per-channel values",
        temporal_compression=4,
    )
    reference_config: ClassVar[dict[str, Any]] = {  # Wan-AI/Wan2.2-TI2V-5B-Diffusers/transformer
        "patch_size": (1, 2, 2),
        "num_attention_heads": 24,
        "attention_head_dim": 128,
        "in_channels": 48,
        "out_channels": 48,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 14336,
        "num_layers": 30,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``WanPipeline`` with ``expand_timesteps``: a tiny UMT5, a tiny Wan 2.2 VAE (2x2
        patchify, 8x down: 16x in space, 4x in time) and Wan's tiny transformer."""
        import torch
        from diffusers import AutoencoderKLWan, WanPipeline

        one = Wan.tiny_pipeline(seed)
        torch.manual_seed(seed + 1)
        z_dim = cls.tiny_config["in_channels"]
        vae = AutoencoderKLWan(  # the Wan 2.2 VAE's layout at a tiny width
            base_dim=8,
            decoder_base_dim=8,
            z_dim=z_dim,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False, True, True],
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            scale_factor_temporal=4,
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        )
        return WanPipeline(
            tokenizer=one.tokenizer,
            text_encoder=one.text_encoder,
            transformer=one.transformer,
            vae=vae,
            scheduler=one.scheduler,
            expand_timesteps=True,
        )

    def encode_condition(self, pipe, name, pixels, clip, micro_batch_size):
        if name != "image":
            return super().encode_condition(pipe, name, pixels, clip, micro_batch_size)
        latents = self.encode_latents(pipe, pixels.unsqueeze(2), micro_batch_size)
        return {FIRST_FRAME: latents}  # what WanImageToVideoPipeline encodes (expand_timesteps)

    def predict(self, model, noisy, sigmas, batch):
        """The velocity with one timestep per token: ``sigma * 1000``, and with a first frame
        (``batch[FIRST_FRAME]``) its latents in place of latent frame 0, at timestep 0."""
        import torch

        dtype = model_dtype(model)
        first = batch.get(FIRST_FRAME)
        if first is not None:
            noisy = torch.cat([first.to(noisy), noisy[:, :, 1:]], dim=2)
        return model(
            hidden_states=noisy.to(dtype),
            timestep=self.token_timesteps(noisy, sigmas, conditioned=first is not None),
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def token_timesteps(
        self, latents: torch.Tensor, sigmas: torch.Tensor, *, conditioned: bool
    ) -> torch.Tensor:
        """Timesteps ``(B, F * H/p * W/p)`` in the transformer's token order (frame-major):
        ``sigma * 1000``, 0 on latent frame 0 when ``conditioned``."""
        b, _, f, h, w = latents.shape
        p = self.latent.patch_size
        per_frame = self.noised_frames(b, f, conditioned, latents.device) * (
            sigmas.float() * 1000
        ).view(b, 1)
        return per_frame.repeat_interleave((h // p) * (w // p), dim=1)

    @staticmethod
    def noised_frames(batch_size: int, frames: int, conditioned: bool, device: Any) -> torch.Tensor:
        """1 for each latent frame that is noised, 0 for a conditioning first frame: (B, F)."""
        import torch

        mask = torch.ones(batch_size, frames, device=device)
        if conditioned:
            mask[:, 0] = 0
        return mask

    def loss(
        self, model: Any, batch: dict[str, torch.Tensor], objective: FlowMatching
    ) -> torch.Tensor:
        """Flow matching; with a first frame, its latent frame is left out of the loss."""
        import torch

        if batch.get(FIRST_FRAME) is None:
            return super().loss(model, batch, objective)
        x0 = batch["latents"].float()
        noise = torch.randn_like(x0)
        shift = self.shift_for(self.seq_len(x0))
        sigmas = objective.sample_sigmas(x0.shape[0], device=x0.device, shift=shift)
        noisy = objective.add_noise(x0, noise, sigmas)
        prediction = self.predict(model, noisy, sigmas, batch)
        error = (prediction.float() - objective.target(x0, noise)).pow(2)[:, :, 1:]
        per_sample = error.flatten(1).mean(1)
        return (per_sample * objective.loss_weight(sigmas).float()).mean()

    def sample(self, pipe, prompts, validation, generator, conditions=None):
        """Text-to-video through ``pipe``; with ``conditions``'s ``image`` (a ``PIL.Image`` per
        prompt), image-to-video through a ``WanImageToVideoPipeline`` of the same parts."""
        import torch
        from diffusers import WanImageToVideoPipeline, WanPipeline

        images = (conditions or {}).get("image")
        if images is None:
            return super().sample(pipe, prompts, validation, generator)
        i2v = WanImageToVideoPipeline(
            tokenizer=pipe.tokenizer,
            text_encoder=pipe.text_encoder,
            vae=pipe.vae,
            scheduler=pipe.scheduler,
            transformer=pipe.transformer,
            expand_timesteps=True,
        )
        i2v.set_progress_bar_config(disable=True)

        def embeds(prompts: list[str]) -> torch.Tensor:  # as WanPipeline, which needs no ftfy
            return WanPipeline._get_t5_prompt_embeds(
                pipe, prompts, max_sequence_length=max_length(pipe.tokenizer), device=pipe.device
            )

        videos = [
            i2v(
                image=image,
                prompt_embeds=embeds([prompt]),
                negative_prompt_embeds=embeds([""]),
                **pipeline_settings(validation, num_frames=validation.frames),
                generator=generator,
                output_type="pt",
            ).frames[0]  # (T, C, H, W) in [0, 1]
            for prompt, image in zip(prompts, images, strict=True)
        ]
        return torch.stack(videos).transpose(1, 2)


__all__ = ["FIRST_FRAME", "Wan22TI2V"]
