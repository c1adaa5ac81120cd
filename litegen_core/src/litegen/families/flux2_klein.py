"""Flux.2 [klein] text-to-image (``Flux2KleinPipeline``, ``Flux2Transformer2DModel``).

A variant of :class:`~litegen.families.flux2.Flux2` keyed by its pipeline class: the same
transformer class (without a guidance embedding), VAE, latent rules, forward, shift, key map and
sequence plan (the registry's ``family_for_transformer`` answers Flux.2 for the shared class,
the first by name; a run finds Klein by its pipeline folder's ``model_index.json``). Its text
encoder is a Qwen3 causal LM: the prompt goes through the tokenizer's chat template as one user
message (thinking off), and the embedding stacks the hidden states of layers 9, 18 and 27 (the
tiny pipeline's three-layer encoder: 1, 2, 3). Not guidance-distilled: the transformer takes no
guidance; the base models sample with classifier-free guidance, the step-distilled ones
(``is_distilled`` in the pipeline's config) without. Reference images as Flux.2.

Example::

    from litegen.families.flux2_klein import Flux2Klein

    pipe = Flux2Klein.tiny_pipeline()  # a Flux2KleinPipeline, a tiny Qwen3 encoder
"""

from __future__ import annotations

from typing import Any, ClassVar

from litegen.families.flux2 import REFERENCE, Flux2


class Flux2Klein(Flux2):
    """Flux.2 [klein]: Flux.2's forward with a Qwen3 encoder's layers 9, 18, 27 and no guidance."""

    name = "flux2_klein"
    pipeline_class = "Flux2KleinPipeline"
    text_encoder_layers: ClassVar[tuple[int, ...]] = (9, 18, 27)  # Qwen3's
    conditions: ClassVar[dict[str, str]] = {
        "prompt_embeds": (
            "the Qwen3 encoder's hidden states at layers 9, 18 and 27, stacked per token (chat "
            "template, one user message; tokenizer length, at most 512)"
        ),
        REFERENCE: Flux2.conditions[REFERENCE],
    }
    reference_config: ClassVar[dict[str, Any]] = {  # black-forest-labs/FLUX.2-klein-4B
        "patch_size": 1,
        "in_channels": 128,
        "num_layers": 5,
        "num_single_layers": 20,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 7680,  # three layers of Qwen3-4B's 2560
        "axes_dims_rope": (32, 32, 32, 32),
        "guidance_embeds": False,
    }
    tiny_config: ClassVar[dict[str, Any]] = {**Flux2.tiny_config, "guidance_embeds": False}

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``Flux2KleinPipeline``: a three-layer Qwen3 encoder of width 32 with a
        chat-template tokenizer, Flux.2's tiny VAE, the MMDiT without guidance embedding."""
        import torch
        from diffusers import (
            FlowMatchEulerDiscreteScheduler,
            Flux2KleinPipeline,
            Flux2Transformer2DModel,
        )
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from litegen.families.tiny_flux2 import tiny_chat_tokenizer, tiny_vae

        torch.manual_seed(seed)
        tokenizer = tiny_chat_tokenizer(64)
        encoder = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                max_position_embeddings=128,
                pad_token_id=0,
            )
        )
        return Flux2KleinPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
            vae=tiny_vae(),
            text_encoder=encoder,
            tokenizer=tokenizer,
            transformer=Flux2Transformer2DModel(**cls.tiny_config),
        )


__all__ = ["Flux2Klein"]
