"""Tiny text encoders and tokenizers for the families' tiny pipelines, built offline.

The tokenizers are byte-level BPEs trained on a few sentences with ``tokenizers`` (no
download): any prompt tokenizes. The encoders have one layer of width 32.

Example::

    tokenizer = tiny_tokenizer(32, bos=False)
    encoder = tiny_t5_encoder(len(tokenizer), umt5=True)
"""

from __future__ import annotations

from typing import Any

CORPUS = [
    "a photo of a red fox in the snow",
    "a video of a cat walking on a wooden table",
    "a clip number zero one two three four five six seven eight nine",
    "a bright landscape with mountains, water and a blue sky at sunset",
]


def tiny_tokenizer(max_length: int, *, bos: bool) -> Any:
    """A byte-level BPE of a few hundred tokens: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, ``<s>`` 3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "</s>", "<unk>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    template = "<s> $A </s>" if bos else "$A </s>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<s>", 3), ("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        bos_token="<s>",
        model_max_length=max_length,
    )


def tiny_t5_encoder(vocab_size: int, *, umt5: bool) -> Any:
    """A one-layer (UM)T5 encoder of width 32."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (
        (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    )
    config = config_class(
        vocab_size=vocab_size,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
    )
    return model_class(config)


def tiny_clip_encoder(vocab_size: int) -> Any:
    """A one-layer ``CLIPTextModel`` of width 32 (Flux's pooled text)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            projection_dim=32,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=3,
        )
    )


__all__ = ["tiny_clip_encoder", "tiny_t5_encoder", "tiny_tokenizer"]
