"""Write a tiny diffusers pipeline folder with random weights, built offline.

    uv run python -m litegen_zoo.make_tiny_pipeline wan  tiny_wan    # text-to-video: WanPipeline
    uv run python -m litegen_zoo.make_tiny_pipeline flux tiny_flux   # text-to-image: FluxPipeline
    uv run python -m litegen_zoo.make_tiny_pipeline wan-1.3b wan_shapes  # GPU benchmarks, see below

The folders have the layout of the published pipelines (``model_index.json``, ``transformer/``,
``vae/``, ``text_encoder*/``, ``tokenizer*/``, ``scheduler/``) and the same latent rules (VAE
downsampling 8 in space, 4 in time for Wan; patches of 2), at a size that trains and samples on
a CPU in seconds: each family's ``tiny_pipeline`` (:mod:`litegen.families`), so every family
of the registry has one. Fine-tuning recipes and their tests point ``finetune.pipeline`` at
these folders; on a GPU node point it at the real pipeline instead.

``wan-1.3b`` has Wan2.1-T2V-1.3B-Diffusers' transformer, VAE and scheduler configs with random
weights, and a one-layer UMT5 of its width (4096) in place of the 5.7B-parameter encoder: the
shapes of a real-size fine-tuning run, for benchmarks on a machine without the published
weights (about 6 GB on disk).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


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

    from litegen.families.tiny_text import tiny_tokenizer
    from litegen.families.wan import Wan

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(512, bos=False)
    transformer = WanTransformer3DModel(**Wan.reference_config)
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


def pipelines() -> dict[str, Callable[[int], Any]]:
    """The pipelines this command writes: each family's tiny one, and ``wan-1.3b``."""
    from litegen.families import families

    return {
        **{name: family.tiny_pipeline for name, family in families().items()},
        "wan-1.3b": wan_1_3b_shapes_pipeline,
    }


def make_tiny_pipeline(family: str, folder: str | Path, seed: int = 0) -> Path:
    """Build the tiny pipeline of ``family`` and ``save_pretrained`` it to ``folder``."""
    choices = pipelines()
    if family not in choices:
        raise ValueError(f"family must be one of {sorted(choices)}, got {family!r}.")
    choices[family](seed).save_pretrained(str(folder))
    return Path(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(pipelines()))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_pipeline(args.family, args.folder, args.seed))


if __name__ == "__main__":
    main()
