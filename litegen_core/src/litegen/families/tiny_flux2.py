"""The tiny parts of the Flux.2 families' tiny pipelines (Flux.2, Flux.2 [klein]), built
offline: a chat-template tokenizer in place of FLUX.2-dev's ``PixtralProcessor`` (which needs
torchvision), an ``AutoencoderKLFlux2`` whose batch-norm statistics are not the identity, and a
tiny ``Mistral3ForConditionalGeneration``.

Example::

    tokenizer = tiny_chat_tokenizer(64)
    encoder = tiny_mistral3_encoder(len(tokenizer), layers=3)
"""

from __future__ import annotations

from typing import Any

# The chat template of the tiny tokenizers: each message's text after its role, one a line.
# Flux2Pipeline's messages hold a list of typed parts (as a multimodal processor takes them),
# Flux2KleinPipeline's a string.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ message['role'] }}: {{ part['text'] }}\n"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def tiny_chat_tokenizer(max_length: int) -> Any:
    """The tiny byte-level tokenizer (``tiny_text``) with a chat template, in place of
    FLUX.2-dev's ``PixtralProcessor`` (which needs torchvision)."""
    from litegen.families.tiny_text import tiny_tokenizer

    tokenizer = tiny_tokenizer(max_length, bos=True)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def tiny_vae() -> Any:
    """An 8x ``AutoencoderKLFlux2`` of 4 latent channels whose batch-norm statistics are not the
    identity (so that tests see them applied)."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    with torch.no_grad():
        vae.bn.running_mean.uniform_(-0.5, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def tiny_mistral3_encoder(vocab_size: int, *, layers: int) -> Any:
    """A ``Mistral3ForConditionalGeneration`` of width 32 with ``layers`` text layers and a
    one-layer vision tower (never used: prompts only)."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    text = MistralConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    vision = PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=32,
        patch_size=4,
    )
    config = Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=2, spatial_merge_size=1
    )
    return Mistral3ForConditionalGeneration(config)


__all__ = ["TINY_CHAT_TEMPLATE", "tiny_chat_tokenizer", "tiny_mistral3_encoder", "tiny_vae"]
