"""Qwen-Image-Edit reference-image editing (``QwenImageEditPipeline``,
``QwenImageTransformer2DModel``).

A variant of :class:`~litegen.families.qwen_image.QwenImage` keyed by its pipeline class: the
same transformer, VAE, latent rules, shift, key map and training forward (the registry's
``family_for_transformer`` answers Qwen-Image for the shared transformer class; a run finds
Qwen-Image-Edit by its pipeline folder's ``model_index.json``). It trains on pairs: a target
image with its caption (the edit instruction) and a reference image, the ``reference`` media
condition (a ``reference`` column of the folder's metadata, or a companion file
``<stem>.reference.<ext>``; required), read at the target's bucket.

The reference goes in twice, as in ``QwenImageEditPipeline``:

- its VAE latents, normalised as the target's, packed into 2x2 tokens after the noisy target's,
  with their own ``img_shapes`` entry; the prediction is cut back to the target's tokens;
- Qwen2.5-VL reads it with the caption: the edit chat template holds the image's vision tokens
  before the caption, and the text condition is the last hidden state after the template's
  first ``prompt_template_encode_start_idx`` tokens (the image's tokens, then the caption's),
  padded to the image's token count plus the tokenizer length (at most 512). Each sample also
  caches the empty caption with its own reference (``empty_caption.prompt_embeds``): caption
  dropout trains the unconditional branch that the pipeline's true classifier-free guidance
  computes, the negative prompt read with the same image.

At training the text encoder sees the reference at the target's bucket; the pipeline resizes
it to about 1024 x 1024 pixels first (for the VAE and the text encoder alike), so validation
samples draw the reference at that size whatever ``trainer.validation``'s height and width.
Validation samples: one pipeline call per prompt with its reference image
(``trainer.validation.conditions.reference``), true classifier-free guidance against an empty
negative prompt when ``trainer.validation.guidance`` is above 1.

The processor: transformers 5's ``Qwen2VLProcessor`` loads (and is built) only with its video
processor, which needs torchvision; LiteGen does not install torchvision. The tiny pipeline has
no processor (``model_index.json``'s ``processor`` is null); LiteGen loads no pipeline's
processor (``unloaded_components``: ``from_pretrained(folder, processor=None)``, as a folder
with a null processor must be loaded in diffusers too) and gives the pipeline one for images
only: its tokenizer and transformers' PIL image processor (``Qwen2VLImageProcessorPil``) at the
settings of the folder's ``processor/preprocessor_config.json`` where it has one.

Example::

    from litegen.families.qwen_image_edit import QwenImageEdit

    pipe = QwenImageEdit.tiny_pipeline()  # a QwenImageEditPipeline of Qwen-Image's tiny parts
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from litegen.families.base import MediaCondition, empty_caption_key, max_length
from litegen.families.qwen_image import (
    QwenImage,
    encode_images,
    guidance_settings,
    text_conditions,
)

if TYPE_CHECKING:
    import torch

REFERENCE = "reference_latents"  # the batch key of the encoded reference image


@functools.cache
def _image_only_processor_class() -> type:
    """``Qwen2VLProcessor`` without its video processor (so without torchvision)."""
    from transformers import Qwen2VLProcessor

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor for text and images: no video processor to load or build."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, **kwargs: Any):
            super().__init__(image_processor, tokenizer, **kwargs)

    return ImageQwen2VLProcessor


def image_processor_for(pipe: Any) -> Any:
    """A ``Qwen2VLProcessor`` of ``pipe``'s tokenizer and transformers' PIL image processor,
    with the settings of the pipeline folder's ``processor/`` where it has one."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    folder = Path(str(getattr(pipe.config, "_name_or_path", "") or "")) / "processor"
    if (folder / "preprocessor_config.json").is_file():
        images = Qwen2VLImageProcessorPil.from_pretrained(folder)
    else:
        images = Qwen2VLImageProcessorPil()
    return _image_only_processor_class()(image_processor=images, tokenizer=pipe.tokenizer)


@contextlib.contextmanager
def with_processor(pipe: Any) -> Iterator[Any]:
    """``pipe``, given :func:`image_processor_for` for the block when it has no processor
    (and none after it: a pipeline saved later writes no processor of LiteGen's)."""
    if getattr(pipe, "processor", None) is not None:
        yield pipe
        return
    pipe.processor = image_processor_for(pipe)  # model_index.json's entry stays null
    try:
        yield pipe
    finally:
        pipe.processor = None


def reference_images(pipe: Any, pixels: torch.Tensor) -> list[Any]:
    """(N, 3, H, W) pixels in [-1, 1] as the ``PIL.Image`` list the pipeline's processor reads."""
    return pipe.image_processor.postprocess(pixels.float(), output_type="pil")


class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit: Qwen-Image's forward over the noisy target's tokens then the
    reference's, its text read by Qwen2.5-VL with the reference image."""

    name = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    unloaded_components = ("processor",)  # transformers builds Qwen2VLProcessor with torchvision
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": "Qwen2.5-VL's last hidden state after the edit chat template, read "
        "with the reference image (its vision tokens, then the caption's), padded to the "
        "image's tokens plus the tokenizer length (at most 512)",
        "prompt_embeds_mask": "1 for the image's and caption's tokens, 0 for the padding",
        empty_caption_key("prompt_embeds"): "the same of the empty caption with the reference",
        empty_caption_key("prompt_embeds_mask"): "its mask",
        REFERENCE: "the reference image's VAE latents, normalised as the target's",
    }
    media_conditions: ClassVar[dict[str, MediaCondition]] = {
        "reference": MediaCondition(
            "image", "the image the caption edits: VAE latents, and read by the text encoder"
        ),
    }

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``QwenImageEditPipeline`` of Qwen-Image's tiny components (the same weights at one
        seed; the tiny Qwen2.5-VL has a vision tower) and no processor (see the module)."""
        from diffusers import QwenImageEditPipeline

        components = QwenImage.tiny_pipeline(seed).components
        return QwenImageEditPipeline(**components, processor=None)

    def encode_text(self, pipe, captions):
        """The captions read with a gray reference of the processor's smallest size: the
        cache's empty-caption entry, of which caption dropout takes only the names (each sample
        brings its own empty caption read with its reference, :meth:`encode_text_with`)."""
        import torch

        gray = torch.zeros(len(captions), 3, 56, 56, device=pipe.device)
        text = self.encode_text_with(pipe, captions, {"reference": gray})
        return {name: text[name] for name in ("prompt_embeds", "prompt_embeds_mask")}

    def encode_text_with(self, pipe, captions, conditions):
        images = reference_images(pipe, conditions["reference"])
        with with_processor(pipe):
            embeds, mask = self.read_text(pipe, captions, images)
            empty, empty_mask = self.read_text(pipe, [""] * len(captions), images)
        # The empty caption is the image's tokens and the template's tail: room for a caption
        # of the tokenizer's length beyond it.
        length = empty.shape[1] + max_length(pipe.tokenizer)
        dropped = text_conditions(empty, empty_mask, length)
        return text_conditions(embeds, mask, length) | {
            empty_caption_key(name): value for name, value in dropped.items()
        }

    def read_text(self, pipe: Any, prompts: list[str], images: list[Any]) -> tuple:
        """The pipeline's prompt embeddings and mask (None when all ones) of each prompt read
        with its image, one image per prompt."""
        return pipe.encode_prompt(prompts, image=images, device=pipe.device)

    def encode_condition(self, pipe, name, pixels, clip, micro_batch_size):
        if name != "reference":
            return super().encode_condition(pipe, name, pixels, clip, micro_batch_size)
        return {REFERENCE: encode_images(pipe.vae, pixels, micro_batch_size)}

    def sample(self, pipe, prompts, validation, generator, conditions=None):
        """One pipeline call per prompt, each editing its reference image (``conditions``'s
        ``reference``, a ``PIL.Image`` per prompt)."""
        import torch

        references = self.inputs_per_prompt(conditions, "reference", prompts)
        with with_processor(pipe):
            images = [
                pipe(
                    image=reference,
                    prompt=prompt,
                    **guidance_settings(validation),
                    generator=generator,
                    output_type="pt",
                ).images
                for prompt, reference in zip(prompts, references, strict=True)
            ]
        return torch.cat(images)  # (N, C, H, W) in [0, 1]


__all__ = ["REFERENCE", "QwenImageEdit", "image_processor_for", "with_processor"]
