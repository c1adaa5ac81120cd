"""Write a tiny diffusers pipeline folder with random weights, built offline.

    uv run python -m litegen_zoo.make_tiny_pipeline wan  tiny_wan    # text-to-video: WanPipeline
    uv run python -m litegen_zoo.make_tiny_pipeline flux tiny_flux   # text-to-image: FluxPipeline
    uv run python -m litegen_zoo.make_tiny_pipeline wan-1.3b wan_shapes  # GPU benchmarks, see below

The folders have the layout of the published pipelines (``model_index.json``, ``transformer/``,
``vae/``, ``text_encoder*/``, ``tokenizer*/``, ``scheduler/``) and the same latent rules (VAE
downsampling 8 in space, 4 in time for Wan; patches of 2), at a size that trains and samples on
a CPU in seconds. The tokenizers are byte-level BPEs trained on a few sentences with
``tokenizers`` (no download): any prompt tokenizes. Fine-tuning recipes and their tests point
``model.pretrained`` at these folders; on a GPU node point it at the real pipeline instead.

``wan-1.3b`` has Wan2.1-T2V-1.3B-Diffusers' transformer, VAE and scheduler configs with random
weights, and a one-layer UMT5 of its width (4096) in place of the 5.7B-parameter encoder: the
shapes of a real-size fine-tuning run, for benchmarks on a machine without the published
weights (about 6 GB on disk).
"""

from __future__ import annotations

import argparse
from pathlib import Path
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


def tiny_wan_pipeline(seed: int = 0) -> Any:
    """A ``WanPipeline``: Wan 2.1's classes (UMT5 text encoder, Wan VAE, Wan transformer)."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(32, bos=False)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(  # 8x in space, 4x in time, as Wan 2.1's
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_t5_encoder(len(tokenizer), umt5=True),
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def tiny_flux_pipeline(seed: int = 0) -> Any:
    """A ``FluxPipeline``: CLIP and T5 text encoders, an 8x ``AutoencoderKL``, Flux's MMDiT."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    clip_tokenizer, t5_tokenizer = tiny_tokenizer(77, bos=True), tiny_tokenizer(32, bos=False)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tokenizer),
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
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels in 2x2 patches
        num_layers=2,  # two of each block: repeated blocks for FSDP and checkpointing
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=0.5,
        shift_factor=0.1,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=tiny_t5_encoder(len(t5_tokenizer), umt5=False),
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def wan_1_3b_shapes_pipeline(seed: int = 0) -> Any:
    """Wan 2.1 T2V 1.3B's transformer, VAE and scheduler (random weights), a shallow UMT5."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(512, bos=False)
    transformer = WanTransformer3DModel(  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers/transformer
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )
    encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=4096,
            d_kv=64,
            d_ff=1024,
            num_layers=1,
            num_heads=64,
            relative_attention_num_buckets=32,
        )
    )
    scheduler = UniPCMultistepScheduler(  # as published: flow sigmas, shift 3
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        transformer=transformer,
        vae=AutoencoderKLWan(),  # its defaults are Wan 2.1's VAE
        scheduler=scheduler,
    )


PIPELINES = {
    "wan": tiny_wan_pipeline,
    "flux": tiny_flux_pipeline,
    "wan-1.3b": wan_1_3b_shapes_pipeline,
}


def make_tiny_pipeline(family: str, folder: str | Path, seed: int = 0) -> Path:
    """Build the tiny pipeline of ``family`` and ``save_pretrained`` it to ``folder``."""
    if family not in PIPELINES:
        raise ValueError(f"family must be one of {sorted(PIPELINES)}, got {family!r}.")
    PIPELINES[family](seed).save_pretrained(str(folder))
    return Path(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(PIPELINES))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_pipeline(args.family, args.folder, args.seed))


if __name__ == "__main__":
    main()
