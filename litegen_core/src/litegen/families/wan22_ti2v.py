"""Wan 2.2 TI2V-5B: text-to-video, and image-to-video from the first frame (``WanPipeline``
with ``expand_timesteps``, ``WanTransformer3DModel``).

Latents: the Wan 2.2 VAE (``AutoencoderKLWan`` with ``is_residual``, ``patch_size`` 2, z_dim 48)
compresses 16x in space (a 2x2 pixel patchify, then 8x) and 4x in time (clips of ``4k + 1``
frames), normalised by the VAE config's ``latents_mean`` and ``latents_std`` as Wan 2.1's;
transformer patches of 1x2x2, so pixel sides are multiples of 32. Condition: the UMT5 prompt
embeddings. The transformer takes one timestep per token (``expand_timesteps``): with
image-to-video, the first latent frame (the image, encoded alone by the causal VAE) keeps
timestep 0 and stays clean, the other frames are noised, and the loss leaves the first frame
out, as diffusers' ``WanImageToVideoPipeline`` samples it. A batch's ``first_frame`` entry (one
flag per sample) asks for that; without it every sample is text-to-video.

Sequence parallelism: Wan's plan, which splits the per-token timesteps with the tokens.

Example::

    from litegen.families.wan22_ti2v import Wan22TI2V

    pipe = Wan22TI2V.tiny_pipeline()  # a WanPipeline with a tiny Wan 2.2 VAE, expand_timesteps
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from litegen.families.base import LatentRules, model_dtype
from litegen.families.wan import Wan

if TYPE_CHECKING:
    import torch

    from litegen.objectives import FlowMatching

FIRST_FRAME = "first_frame"  # the batch entry: per sample, whether its first frame conditions


class Wan22TI2V(Wan):
    """Wan 2.2 TI2V-5B: the Wan 2.2 VAE (16x in space), per-token timesteps, first-frame I2V."""

    name = "wan22_ti2v"
    model_index_keys = ("expand_timesteps",)
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

    def predict(self, model, noisy, sigmas, batch):
        """The velocity with one timestep per token: ``sigma * 1000``, 0 on the first latent
        frame of the samples that ``batch[FIRST_FRAME]`` marks."""
        dtype = model_dtype(model)
        return model(
            hidden_states=noisy.to(dtype),
            timestep=self.token_timesteps(noisy, sigmas, batch.get(FIRST_FRAME)),
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def token_timesteps(
        self, latents: torch.Tensor, sigmas: torch.Tensor, first_frame: torch.Tensor | None
    ) -> torch.Tensor:
        """Timesteps ``(B, F * H/p * W/p)`` in the transformer's token order (frame-major)."""
        import torch

        b, _, f, h, w = latents.shape
        p = self.latent.patch_size
        noisy = self.noised_frames(b, f, first_frame, latents.device)  # (B, F)
        per_frame = noisy * (sigmas.float() * 1000).view(b, 1)
        return per_frame.repeat_interleave((h // p) * (w // p), dim=1).to(torch.float32)

    @staticmethod
    def noised_frames(
        batch_size: int, frames: int, first_frame: torch.Tensor | None, device: Any
    ) -> torch.Tensor:
        """1 for each latent frame that is noised, 0 for a conditioning first frame: (B, F)."""
        import torch

        mask = torch.ones(batch_size, frames, device=device)
        if first_frame is not None:
            mask[:, 0] = 1 - first_frame.to(device=device, dtype=mask.dtype).reshape(-1)
        return mask

    def loss(
        self, model: Any, batch: dict[str, torch.Tensor], objective: FlowMatching
    ) -> torch.Tensor:
        """Flow matching with the conditioning first frames kept clean and left out of the loss."""
        import torch

        x0 = batch["latents"].float()
        noise = torch.randn_like(x0)
        shift = self.shift_for(self.seq_len(x0))
        sigmas = objective.sample_sigmas(x0.shape[0], device=x0.device, shift=shift)
        noisy = objective.add_noise(x0, noise, sigmas)
        if batch.get(FIRST_FRAME) is None:
            prediction = self.predict(model, noisy, sigmas, batch)
            return objective.loss(prediction, x0, noise, sigmas)
        frames = self.noised_frames(x0.shape[0], x0.shape[2], batch[FIRST_FRAME], x0.device)
        mask = frames.view(x0.shape[0], 1, -1, 1, 1)
        noisy = mask * noisy + (1 - mask) * x0  # the image's latents, clean
        prediction = self.predict(model, noisy, sigmas, batch)
        error = (prediction.float() - objective.target(x0, noise)).pow(2) * mask
        counted = mask.expand_as(error).flatten(1).sum(1).clamp(min=1)
        per_sample = error.flatten(1).sum(1) / counted
        return (per_sample * objective.loss_weight(sigmas).float()).mean()


__all__ = ["FIRST_FRAME", "Wan22TI2V"]
