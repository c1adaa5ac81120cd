"""Pipelines at the published models' sizes with random weights, for GPU benchmarks of the
fine-tuning road on a machine without the published weights.

    python3 -m litegen_zoo.make_tiny_pipeline wan-i2v-14b /tmp/wan_i2v_14b   # ~30 GB on disk

Each has the published transformer and VAE configs (the transformer stored in bf16, built on
the GPU when there is one: seconds rather than minutes on a CPU), the published scheduler, and
one-layer text encoders of the real widths in place of the multi-billion-parameter ones: the
text encoders run once per caption, into the cache, and leave the training step's shapes
unchanged. The image encoder of Wan 2.1 I2V (a CLIP ViT-H/14, 0.6B) is kept at its size.

- ``wan-1.3b``: Wan2.1-T2V-1.3B-Diffusers;
- ``wan-i2v-14b``: Wan2.1-I2V-14B-480P-Diffusers (``WanImageToVideoPipeline``);
- ``flux-dev``: FLUX.1-dev (19 double-stream and 38 single-stream blocks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def _built_in_bf16_on_the_gpu() -> Iterator[None]:
    """Modules made inside are made in bf16 on the GPU when there is one."""
    import torch

    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def _umt5(vocab_size: int) -> Any:
    """One UMT5 layer of the published encoder's width (4096)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=vocab_size,
            d_model=4096,
            d_kv=64,
            d_ff=1024,
            num_layers=1,
            num_heads=64,
            relative_attention_num_buckets=32,
        )
    )


def _wan_scheduler() -> Any:
    from diffusers import UniPCMultistepScheduler

    # as published: flow sigmas, shift 3
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )


def wan_1_3b_pipeline(seed: int = 0) -> Any:
    """Wan 2.1 T2V 1.3B's transformer, VAE and scheduler (random weights), a shallow UMT5.

    Example::

        wan_1_3b_pipeline().save_pretrained("/tmp/wan_1_3b")
    """
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    from litegen.families.tiny_text import tiny_tokenizer
    from litegen.families.wan import Wan

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(512, bos=False)
    with _built_in_bf16_on_the_gpu():
        transformer = WanTransformer3DModel(**Wan.reference_config)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_umt5(len(tokenizer)),
        transformer=transformer.to("cpu"),
        vae=AutoencoderKLWan(),  # its defaults are Wan 2.1's VAE
        scheduler=_wan_scheduler(),
    )


def wan_i2v_14b_pipeline(seed: int = 0) -> Any:
    """Wan 2.1 I2V 14B 480P's transformer, CLIP ViT-H/14 image encoder, VAE and scheduler
    (random weights), a shallow UMT5.

    Example::

        wan_i2v_14b_pipeline().save_pretrained("/tmp/wan_i2v_14b")
    """
    import torch
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPVisionConfig, CLIPVisionModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from litegen.families.tiny_text import tiny_tokenizer
    from litegen.families.wan import WanI2V

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(512, bos=False)
    with _built_in_bf16_on_the_gpu():
        transformer = WanTransformer3DModel(**WanI2V.reference_config)
    image_encoder = CLIPVisionModel(  # open-clip ViT-H/14, as the published image_encoder
        CLIPVisionConfig(
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=16,
            image_size=224,
            patch_size=14,
            projection_dim=1024,
            hidden_act="gelu",
        )
    )
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=_umt5(len(tokenizer)),
        vae=AutoencoderKLWan(),
        scheduler=_wan_scheduler(),
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
        ),
        image_encoder=image_encoder,
        transformer=transformer.to("cpu"),
    )


def flux_dev_pipeline(seed: int = 0, layers: int = 19, single_layers: int = 38) -> Any:
    """FLUX.1-dev's transformer (``layers`` double-stream and ``single_layers`` single-stream
    blocks; the published 19 and 38 by default), VAE and scheduler with random weights, and
    one-layer text encoders of the real widths (CLIP 768, T5 4096).

    Example::

        flux_dev_pipeline(layers=4, single_layers=8).save_pretrained("/tmp/flux_shallow")
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from litegen.families.tiny_text import tiny_tokenizer

    torch.manual_seed(seed)
    clip_tokenizer, t5_tokenizer = tiny_tokenizer(77, bos=True), tiny_tokenizer(512, bos=False)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tokenizer),
            hidden_size=768,
            intermediate_size=1024,
            num_hidden_layers=1,
            num_attention_heads=12,
            max_position_embeddings=77,
            projection_dim=768,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=3,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tokenizer),
            d_model=4096,
            d_kv=64,
            d_ff=1024,
            num_layers=1,
            num_heads=64,
            relative_attention_num_buckets=32,
        )
    )
    with _built_in_bf16_on_the_gpu():
        transformer = FluxTransformer2DModel(  # black-forest-labs/FLUX.1-dev/transformer
            patch_size=1,
            in_channels=64,
            num_layers=layers,
            num_single_layers=single_layers,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=[16, 56, 56],
        )
    vae = AutoencoderKL(  # FLUX.1-dev/vae
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        base_shift=0.5,
        max_shift=1.15,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
        transformer=transformer.to("cpu"),
    )


PIPELINES = {
    "wan-1.3b": wan_1_3b_pipeline,
    "wan-i2v-14b": wan_i2v_14b_pipeline,
    "flux-dev": flux_dev_pipeline,
}
