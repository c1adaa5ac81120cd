"""The longest clip each big-model setting fits on a card, by ``inspect-config --estimate``.

For each ``big_models.py`` case and card size: the most latent frames (at the case's height and
width) whose estimated peak stays within ``TIGHT_SHARE`` of the card, the share under which the
estimate says ``fits`` rather than ``tight`` (the allocator's fragmentation is not in the
estimate). Runs on a CPU in seconds per probe: the models are built on the meta device.

    python -m scripts.bench.longest_estimate
    python -m scripts.bench.longest_estimate --cases wan14b-lora-ac --cards 79.2,139 --size 90x160
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from litegen_cli.estimate import GIB, TIGHT_SHARE, estimate_recipe
from litegen_cli.recipe import load_recipe
from scripts.bench import big_models
from scripts.bench.length_search import longest

# The patch of Wan and HunyuanVideo (1 x 2 x 2) and their VAEs' 4x temporal compression.
TOKENS_PER_LATENT_PIXEL = 1 / 4
VIDEO_FRAMES_PER_LATENT = 4


def peak_gib(recipe: Path, frames: int, size: tuple[int, int]) -> float:
    """The estimated peak in GiB of ``recipe`` at ``frames`` latent frames of ``size``."""
    height, width = size
    overrides = [
        f"model.{key}={value}"
        for key, value in zip(("frames", "height", "width"), (frames, height, width), strict=True)
    ]
    return estimate_recipe(load_recipe(recipe, [*overrides, "runtime.device=cuda"])).peak / GIB


def longest_frames(recipe: Path, card_gib: float, size: tuple[int, int], limit: int) -> int:
    """The most latent frames of ``size`` (at most ``limit``, 0 if none) whose estimated peak
    stays within ``TIGHT_SHARE`` of a ``card_gib`` card."""
    return longest(
        lambda frames: peak_gib(recipe, frames, size) <= TIGHT_SHARE * card_gib,
        start=4,
        step=1,
        limit=limit,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="wan14b-lora-fp8-swap,wan14b-lora-ac,wan14b-full")
    p.add_argument("--cards", default="79.2,139", help="device memory in GiB, comma-separated")
    p.add_argument("--size", default="90x160", help="latent height x width (720p: 90x160)")
    p.add_argument("--limit", type=int, default=256, help="most latent frames tried")
    args = p.parse_args()
    size = tuple(int(n) for n in args.size.split("x"))
    recipe_args = argparse.Namespace(tiny=False, tokens=None, device="cuda", steps=2)
    folder = Path(tempfile.mkdtemp(prefix="longest-"))
    print(
        f"{'case':24} {'card GiB':>8} {'latent frames':>13} {'video frames':>12} "
        f"{'tokens':>8} {'est. GiB':>8}"
    )
    for case in args.cases.split(","):
        recipe = big_models.write_recipe(folder, case, recipe_args)
        for card in (float(c) for c in args.cards.split(",")):
            frames = longest_frames(recipe, card, size, args.limit)
            tokens = int(frames * size[0] * size[1] * TOKENS_PER_LATENT_PIXEL)
            if not frames:
                print(f"{case:24} {card:8.1f} {'none fits':>13}")
                continue
            video_frames = (frames - 1) * VIDEO_FRAMES_PER_LATENT + 1
            print(
                f"{case:24} {card:8.1f} {frames:13d} {video_frames:12d} {tokens:8d} "
                f"{peak_gib(recipe, frames, size):8.1f}"
            )


if __name__ == "__main__":
    main()
