"""Qwen-Image-Edit-2509 and later, one reference per sample (``QwenImageEditPlusPipeline``,
``QwenImageTransformer2DModel``).

A variant of :class:`~litegen.families.qwen_image_edit.QwenImageEdit`: the same ``reference``
media condition, latents, forward, caption dropout, processor and key map. Its pipeline names
each image in the prompt (``Picture 1: <image>`` before the caption) and reads every image it is
given with every prompt, so the family reads each sample's caption with its own reference, one
call per sample. At sampling the pipeline reads the reference at about 384 x 384 pixels with
the text encoder and at about 1024 x 1024 with the VAE; training reads both at the target's
bucket. Several references per sample are not trained.

Example::

    from litegen.families.qwen_image_edit_plus import QwenImageEditPlus

    pipe = QwenImageEditPlus.tiny_pipeline()  # a QwenImageEditPlusPipeline of Qwen-Image's tiny parts
"""

from __future__ import annotations

from typing import Any

from litegen.families.qwen_image import QwenImage, text_conditions
from litegen.families.qwen_image_edit import QwenImageEdit


class QwenImageEditPlus(QwenImageEdit):
    """Qwen-Image-Edit-2509: Qwen-Image-Edit's training with the Plus pipeline's prompt."""

    name = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``QwenImageEditPlusPipeline`` of Qwen-Image's tiny components and no processor."""
        from diffusers import QwenImageEditPlusPipeline

        components = QwenImage.tiny_pipeline(seed).components
        return QwenImageEditPlusPipeline(**components, processor=None)

    def read_text(self, pipe, prompts, images):
        """One call per prompt with its image (the pipeline reads all its images with every
        prompt), padded to the longest."""
        import torch

        rows = [
            pipe.encode_prompt([prompt], image=[image], device=pipe.device)
            for prompt, image in zip(prompts, images, strict=True)
        ]
        longest = max(embeds.shape[1] for embeds, _ in rows)
        padded = [text_conditions(embeds, mask, longest) for embeds, mask in rows]
        embeds = torch.cat([row["prompt_embeds"] for row in padded])
        return embeds, torch.cat([row["prompt_embeds_mask"] for row in padded])


__all__ = ["QwenImageEditPlus"]
