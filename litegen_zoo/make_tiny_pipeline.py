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

``wan-1.3b``, ``wan-i2v-14b`` and ``flux-dev`` have the published transformers and VAEs with
random weights and shallow text encoders (:mod:`litegen_zoo.real_size_pipelines`): the shapes of
a real-size fine-tuning run, for GPU benchmarks on a machine without the published weights.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def pipelines() -> dict[str, Callable[[int], Any]]:
    """The pipelines this command writes: each family's tiny one, and the real-size ones."""
    from litegen.families import families
    from litegen_zoo.real_size_pipelines import PIPELINES

    return {**{name: family.tiny_pipeline for name, family in families().items()}, **PIPELINES}


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
