"""Tiny Qwen2.5-VL text encoders and Qwen2 tokenizers for the tiny pipelines of the families
that encode text with Qwen (Qwen-Image, HunyuanVideo 1.5), built offline.

The tokenizer is a byte-level BPE with Qwen2's special tokens, split and chat template,
trained on the tiny corpus and the pipelines' prompt templates: their words are one token
each, so a template's head is as many tokens as with Qwen's own tokenizer and the pipelines
drop exactly the template (``prompt_template_encode_start_idx``).

Example::

    tokenizer = tiny_qwen_tokenizer(32)
    encoder = tiny_qwen_vl(tokenizer)
"""

from __future__ import annotations

from typing import Any

# The chat templates of QwenImagePipeline and QwenImageEditPipeline, {} for the prompt: the
# tiny tokenizer learns their words whole, so their prefixes tokenize to Qwen's own counts.
CHAT_TEMPLATES = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter "
    "or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n",
)
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2's pre-tokenizer split: words with their leading space, digits one by one.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tiny_qwen_tokenizer(max_length: int, more: tuple[str, ...] = ()) -> Any:
    """A byte-level BPE with Qwen2's special tokens and split, trained on the tiny corpus, the
    chat templates and ``more``: any prompt tokenizes, the templates' words are one token each.
    Its chat template is Qwen2's for system and user messages."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from litegen.families.tiny_text import CORPUS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [*CORPUS, *(t.format("") for t in CHAT_TEMPLATES), *more]
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        model_max_length=max_length,
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def tiny_qwen_vl(tokenizer: Any) -> Any:
    """A ``Qwen2_5_VLForConditionalGeneration`` of width 32, one text layer and one vision
    block (patches of 14, merged 2x2), its special token ids those of ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "bos_token_id": None,
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],  # half the head width of 16
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


__all__ = ["CHAT_TEMPLATES", "tiny_qwen_tokenizer", "tiny_qwen_vl"]
