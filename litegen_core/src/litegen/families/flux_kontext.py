"""Flux.1 Kontext reference-image editing (``FluxKontextPipeline``, ``FluxTransformer2DModel``).

A variant of :class:`~litegen.families.flux.Flux` keyed by its pipeline class: the same
transformer, VAE, text encoders, latent rules, shift, key map and sequence plan (the registry's
``family_for_transformer`` answers Flux for the shared transformer class, the first by name; a
run finds Kontext by its pipeline folder's ``model_index.json``). It trains on pairs: a target
image with its caption, and a reference image (the picture the caption edits), the
``reference`` media condition (a ``reference`` column of the folder's metadata, or a companion
file ``<stem>.reference.<ext>``; required), read at the target's bucket. The reference's latents,
normalised as the target's, are packed into 2x2 tokens and appended after the noisy target's
tokens, with their own position ids ``(1, row, column)`` (the target's first id is 0); the
transformer's prediction is cut back to the target's tokens, so the loss counts the target
only, as ``FluxKontextPipeline`` cuts its prediction. Validation samples go through
``FluxKontextPipeline``, one call per prompt with its reference image
(``trainer.validation.conditions.reference``), with the pipeline's resizing to its preferred
resolutions off (``_auto_resize=False``: the reference keeps its size, rounded down to 16 pixels)
and its output area that of ``trainer.validation``'s height and width. Under sequence parallelism
the target's and the reference's tokens are split together, as one image sequence.

Example::

    from litegen.families.flux_kontext import FluxKontext

    pipe = FluxKontext.tiny_pipeline()  # a FluxKontextPipeline of Flux's tiny components
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from litegen.families.base import (
    MediaCondition,
    max_length,
    model_config,
    model_dtype,
    pipeline_settings,
)
from litegen.families.flux import Flux
from litegen.families.packing import image_ids, pack, unpack

if TYPE_CHECKING:
    import torch

REFERENCE = "reference_latents"  # the batch key of the encoded reference image


def reference_ids(height: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of a reference image's packed tokens: (1, row, column)."""
    ids = image_ids(height, width, device)
    ids[:, 0] = 1
    return ids


class FluxKontext(Flux):
    """Flux.1 Kontext: Flux.1's forward over the noisy target's tokens then the reference's."""

    name = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    conditions: ClassVar[dict[str, str]] = {
        **Flux.conditions,
        REFERENCE: "the reference image's VAE latents, normalised as the target's",
    }
    media_conditions: ClassVar[dict[str, MediaCondition]] = {
        "reference": MediaCondition("image", "the image the caption edits"),
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``FluxKontextPipeline`` of Flux's tiny components (the same weights at one seed)."""
        from diffusers import FluxKontextPipeline

        components = Flux.tiny_pipeline(seed).components
        return FluxKontextPipeline(**components)

    def encode_condition(self, pipe, name, pixels, clip, micro_batch_size):
        if name != "reference":
            return super().encode_condition(pipe, name, pixels, clip, micro_batch_size)
        return {REFERENCE: self.encode_latents(pipe, pixels, micro_batch_size)}

    def predict(self, model, noisy, sigmas, batch):
        import torch

        b, _, h, w = noisy.shape
        reference = batch[REFERENCE]
        rh, rw = reference.shape[-2:]
        dtype = model_dtype(model)
        text = batch["prompt_embeds"].to(dtype)
        guidance = None
        if model_config(model).guidance_embeds:  # FLUX.1-Kontext-dev is guidance-distilled
            guidance = batch.get("guidance", torch.ones(b, device=noisy.device))
        target_tokens = pack(noisy)
        tokens = torch.cat([target_tokens, pack(reference.to(noisy))], dim=1)
        ids = torch.cat([image_ids(h, w, noisy.device), reference_ids(rh, rw, noisy.device)])
        prediction = model(
            hidden_states=tokens.to(dtype),
            timestep=sigmas.to(dtype),
            guidance=guidance,
            pooled_projections=batch["pooled"].to(dtype),
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=noisy.device, dtype=dtype),
            img_ids=ids.to(dtype),
            return_dict=False,
        )[0]
        return unpack(prediction[:, : target_tokens.shape[1]], h, w)  # the target's tokens

    def sample(self, pipe, prompts, validation, generator, conditions=None):
        """One pipeline call per prompt, each editing its reference image (``conditions``'s
        ``reference``, a ``PIL.Image`` per prompt)."""
        import torch

        references = self.inputs_per_prompt(conditions, "reference", prompts)
        # The pipeline scales its output to max_area (1024^2 by default) at the asked aspect.
        sizes = {}
        if validation.height and validation.width:
            sizes["max_area"] = validation.height * validation.width
        images = [
            pipe(
                image=reference,
                prompt=prompt,
                **pipeline_settings(validation),
                max_sequence_length=max_length(pipe.tokenizer_2),
                generator=generator,
                output_type="pt",
                _auto_resize=False,
                **sizes,
            ).images
            for prompt, reference in zip(prompts, references, strict=True)
        ]
        return torch.cat(images)  # (N, C, H, W) in [0, 1]


__all__ = ["REFERENCE", "FluxKontext", "reference_ids"]
