"""The model families recipes/finetune.py trains: how each encodes, predicts and samples.

A family is the few lines that differ between pipelines: how the VAE's latents are normalised,
which text embeddings the transformer takes, how the transformer is called, and how its
pipeline samples. The rest (data, cache, objective, loop, export) is shared. Add a family with a
:class:`Family` subclass and one line in :data:`FAMILIES`, keyed by the pipeline class named in
``model_index.json``.
"""

from __future__ import annotations

from typing import Any

import torch

from litegen.data import MediaBuckets
from litegen.objectives import FlowMatching, resolution_shift
from litegen.utils.encode import vae_encode


class Family:
    """A pipeline family: latents, text embeddings, the transformer's forward, sampling.

    ``scheduler_config`` is the pipeline's: a dynamic-shifting one (Flux, LTX-Video) shifts
    the noise levels by the latent sequence length, as the pipeline does when it samples.
    """

    spatial_multiple = 16  # VAE downsampling (8) x patch size (2)

    def __init__(self, scheduler_config: dict[str, Any]) -> None:
        self.scheduler_config = scheduler_config

    def shift_for(self, seq_len: int) -> float | None:
        """The shift the pipeline samples ``seq_len`` tokens with, if it shifts by resolution."""
        config = self.scheduler_config
        if not config.get("use_dynamic_shifting"):
            return None  # the objective's own shift, from the config
        return resolution_shift(
            seq_len,
            base_seq_len=config.get("base_image_seq_len", 256),
            max_seq_len=config.get("max_image_seq_len", 4096),
            base_shift=config.get("base_shift", 0.5),
            max_shift=config.get("max_shift", 1.15),
        )

    def buckets(self, pipe_config: dict[str, Any], data: Any) -> MediaBuckets:
        """The bucket rule of this family at the recipe's ``data.*`` settings."""
        raise NotImplementedError

    def latents(self, pipe: Any, pixels: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
        """Latents of a batch of one shape, normalised as the pipeline's decode expects; the
        VAE sees ``micro_batch_size`` samples at a time."""
        raise NotImplementedError

    def text(self, pipe: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """The text embeddings the transformer takes, one row per caption."""
        raise NotImplementedError

    def loss(
        self, model: Any, batch: dict[str, torch.Tensor], objective: FlowMatching
    ) -> torch.Tensor:
        """The flow-matching loss of a batch of cached latents and embeddings."""
        raise NotImplementedError

    def sample(
        self, pipe: Any, prompts: list[str], validation: Any, generator: torch.Generator
    ) -> torch.Tensor:
        """Samples of ``prompts``: images ``(N, C, H, W)`` or videos ``(N, C, T, H, W)`` in [0, 1]."""
        raise NotImplementedError


def _max_length(tokenizer: Any) -> int:
    """The tokenizer's length, at most 512 (a tokenizer without one says 10^30)."""
    return min(int(tokenizer.model_max_length), 512)


def _settings(validation: Any, **more: Any) -> dict[str, Any]:
    """The pipeline arguments ``trainer.validation`` sets; the unset ones keep their defaults."""
    given = {
        "height": validation.height,
        "width": validation.width,
        "num_inference_steps": validation.steps,
        "guidance_scale": validation.guidance,
        **more,
    }
    return {name: value for name, value in given.items() if value is not None}


def _dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype  # bf16 under the bf16-mixed preset


class Wan(Family):
    """Wan 2.1 text-to-video: UMT5 embeddings, latents normalised by the VAE's mean and std."""

    def buckets(self, pipe_config, data):
        temporal = 2 ** sum(pipe_config["vae"]["temperal_downsample"])
        return MediaBuckets(
            resolution=data.resolution,
            spatial_multiple=self.spatial_multiple,
            max_frames=data.max_frames,
            temporal_compression=temporal,
            frame_stride=data.frame_stride,
        )

    def latents(self, pipe, pixels, micro_batch_size):
        vae = pipe.vae
        latents = vae_encode(
            vae, pixels, micro_batch_size=micro_batch_size, sample=False, scale=False
        )
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
        return (latents - mean) / std

    def text(self, pipe, captions):
        prompt_embeds, _ = pipe.encode_prompt(
            captions,
            do_classifier_free_guidance=False,
            max_sequence_length=_max_length(pipe.tokenizer),
            device=pipe.device,
        )
        return {"prompt_embeds": prompt_embeds}

    def loss(self, model, batch, objective):
        x0 = batch["latents"].float()
        noise = torch.randn_like(x0)
        sigmas = objective.sample_sigmas(x0.shape[0], device=x0.device)
        noisy = objective.add_noise(x0, noise, sigmas)
        dtype = _dtype(model)
        prediction = model(
            hidden_states=noisy.to(dtype),
            timestep=objective.timesteps(sigmas),
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]
        return objective.loss(prediction, x0, noise, sigmas)

    def sample(self, pipe, prompts, validation, generator):
        frames = pipe(
            prompt=prompts,
            **_settings(validation, num_frames=validation.frames),
            max_sequence_length=_max_length(pipe.tokenizer),
            generator=generator,
            output_type="pt",
        ).frames  # (N, T, C, H, W) in [0, 1]
        return frames.transpose(1, 2)


class Flux(Family):
    """Flux text-to-image: CLIP pooled + T5 embeddings, 2x2-packed latents, resolution shift."""

    def buckets(self, pipe_config, data):
        return MediaBuckets(resolution=data.resolution, spatial_multiple=self.spatial_multiple)

    def latents(self, pipe, pixels, micro_batch_size):
        # (z - shift_factor) * scaling_factor, the inverse of the pipeline's decode.
        return vae_encode(pipe.vae, pixels, micro_batch_size=micro_batch_size, sample=False)

    def text(self, pipe, captions):
        prompt_embeds, pooled, _ = pipe.encode_prompt(
            captions,
            prompt_2=None,
            max_sequence_length=_max_length(pipe.tokenizer_2),
            device=pipe.device,
        )
        return {"prompt_embeds": prompt_embeds, "pooled": pooled}

    def loss(self, model, batch, objective):
        from diffusers import FluxPipeline

        latents = batch["latents"].float()  # (B, C, H, W)
        b, c, h, w = latents.shape
        # The transformer sees 2x2 patches as tokens; the loss is the same in that layout.
        x0 = FluxPipeline._pack_latents(latents, b, c, h, w)
        noise = torch.randn_like(x0)
        sigmas = objective.sample_sigmas(b, device=x0.device, shift=self.shift_for(x0.shape[1]))
        noisy = objective.add_noise(x0, noise, sigmas)
        dtype = _dtype(model)
        image_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, dtype)
        text_ids = torch.zeros(batch["prompt_embeds"].shape[1], 3, device=x0.device, dtype=dtype)
        guidance = None
        if model.config.guidance_embeds:  # guidance-distilled (FLUX.1-dev): train at 1.0
            guidance = torch.ones(b, device=x0.device)
        prediction = model(
            hidden_states=noisy.to(dtype),
            timestep=sigmas.to(dtype),  # Flux takes timestep / 1000: the noise level itself
            guidance=guidance,
            pooled_projections=batch["pooled"].to(dtype),
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]
        return objective.loss(prediction, x0, noise, sigmas)

    def sample(self, pipe, prompts, validation, generator):
        return pipe(
            prompt=prompts,
            **_settings(validation),
            max_sequence_length=_max_length(pipe.tokenizer_2),
            generator=generator,
            output_type="pt",
        ).images  # (N, C, H, W) in [0, 1]


FAMILIES: dict[str, type[Family]] = {"WanPipeline": Wan, "FluxPipeline": Flux}


def family_of(model_index: dict[str, Any], folder: str, scheduler_config: dict[str, Any]) -> Family:
    """The family of a pipeline folder, or a ValueError naming the folder and the choices."""
    pipeline_class = model_index.get("_class_name", "?")
    if pipeline_class not in FAMILIES:
        raise ValueError(
            f"model.pretrained {folder} is a {pipeline_class}, which recipes/finetune.py does "
            f"not train; it trains {sorted(FAMILIES)} (add a Family in finetune_families.py)."
        )
    return FAMILIES[pipeline_class](scheduler_config)


__all__ = ["FAMILIES", "Family", "Flux", "Wan", "family_of"]
