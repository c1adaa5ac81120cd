"""The shipped recipes, shortened, through `litegen launch` with 2 gloo ranks on the CPU.

Five launches (about 30 s each on 2 cores): the autoencoder, the latent DiT twice (the first
run fills the latent cache, the second only reads it), the pixel-space digits DiT and the LoRA
fine-tune of a diffusers transformer. The GPU recipes (DiT-XL/2, Wan 2.1) run tiny in one group
of 2 forked ranks, without a launch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from litegen.entry import load_entry
from litegen_cli.app import app
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TIMEOUT_S = 300
NUM_DIGITS = 1797  # scikit-learn's digits
# A small DiT and a few sampling steps: the runs check the plumbing, not the samples.
SMALL_DIT = ["model.hidden_size=32", "model.depth=1", "sampling.steps=2", "sampling.per_class=2"]


def launch(recipe: str, *overrides: str, cwd: Path) -> str:
    """Run `litegen launch recipes/RECIPE OVERRIDES` to the end; return its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    args = [sys.executable, "-m", "litegen_cli.app", "launch", str(RECIPES / recipe), *overrides]
    try:
        proc = subprocess.run(
            args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{recipe} did not finish in {TIMEOUT_S}s:\n{str(err.output)[-4000:]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def epochs(results: Path) -> list[dict]:
    return [json.loads(line) for line in (results / "cache_epochs.jsonl").read_text().splitlines()]


def cached_keys(cache_root: Path) -> tuple[set[str], set[str]]:
    """(keys stored, shard index files) across every fingerprint folder."""
    keys, shard_files = set(), set()
    for index in cache_root.glob("*/*.json"):
        keys |= set(json.loads(index.read_text())["entries"])
        shard_files.add(index.relative_to(cache_root).as_posix())
    return keys, shard_files


def test_autoencoder_then_latent_dit_with_cache(tmp_path):
    ae_results, cache_root = tmp_path / "autoencoder", tmp_path / "cache"
    launch("digits_autoencoder.yaml", "max_steps=8", f"results_dir={ae_results}", cwd=tmp_path)
    checkpoint = ae_results / "digits_autoencoder.pth"
    assert checkpoint.is_file()
    assert (ae_results / "reconstructions.png").is_file()

    latent = [
        f"autoencoder.checkpoint={checkpoint}",
        f"latent_cache.root={cache_root}",
        "trainer.log_every=5",
        *SMALL_DIT,
    ]
    # 16 steps of 128 samples: epoch 1 (steps 1-15, 1797 digits) fills the cache, and the
    # start of epoch 2 reads it.
    first = tmp_path / "latent1"
    out = launch("digits_latent_dit.yaml", "max_steps=16", f"results_dir={first}", *latent,
                 cwd=tmp_path)  # fmt: skip
    assert "cache: epoch 1:" in out  # rank 0 logs the stats
    fill, after = epochs(first)
    assert (fill["epoch"], fill["partial"], fill["steps"]) == (1, False, 15)
    # Every digit was encoded once; at most the step that crosses into epoch 2 re-encodes a
    # few that the other rank had not written yet.
    assert NUM_DIGITS <= fill["misses"] < NUM_DIGITS + 128
    assert fill["bytes_written"] > 0 and fill["encode_s"] > 0
    assert (after["epoch"], after["partial"], after["misses"], after["hits"]) == (2, True, 0, 128)
    keys, shards = cached_keys(cache_root)
    assert keys == {str(i) for i in range(NUM_DIGITS)}
    assert len(shards) == 2  # one shard per rank, written at the end of epoch 1
    assert (first / "samples.png").is_file()
    assert (first / "digits_latent_dit.pth").is_file()

    # `litegen cache build` in this process finds every latent the ranks wrote: same
    # fingerprint from another process, and nothing is encoded again.
    recipe = str(RECIPES / "digits_latent_dit.yaml")
    build = ["cache", "build", recipe, *latent, "--nproc", "1"]
    result = CliRunner().invoke(app, build, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert re.search(rf"hits \(already cached\)\s*│\s*{NUM_DIGITS}\s*│", result.output)
    assert re.search(r"misses \(encoded now\)\s*│\s*0\s*│", result.output)

    # A second run reads every latent from the cache and writes nothing.
    second = tmp_path / "latent2"
    launch("digits_latent_dit.yaml", "max_steps=3", f"results_dir={second}", *latent, cwd=tmp_path)
    (only,) = epochs(second)
    assert (only["misses"], only["hits"], only["bytes_written"]) == (0, 3 * 128, 0)
    assert only["bytes_read"] > 0
    assert cached_keys(cache_root) == (keys, shards)
    assert (second / "samples.png").is_file()


def test_digits_dit_writes_samples(tmp_path):
    results = tmp_path / "digits_dit"
    out = launch("digits_dit.yaml", "max_steps=10", f"results_dir={results}", *SMALL_DIT,
                 "trainer.sample_every=5", cwd=tmp_path)  # fmt: skip
    assert f"samples written to {results / 'samples.png'}" in out
    assert (results / "samples.png").stat().st_size > 0
    during = sorted(p.relative_to(results).as_posix() for p in results.glob("samples/*/*"))
    assert during == ["samples/step_10/samples.png", "samples/step_5/samples.png"]
    assert len((results / "metrics.jsonl").read_text().splitlines()) > 0


def test_lora_dit_writes_adapters_that_diffusers_loads(tmp_path):
    results = tmp_path / "lora_dit"
    out = launch("lora_dit.yaml", "max_steps=4", f"results_dir={results}", "model.depth=1",
                 "sampling.steps=2", "sampling.per_class=2", cwd=tmp_path)  # fmt: skip
    adapters = results / "lora_dit.ema.lora.safetensors"
    assert f"adapters loaded through diffusers from {adapters}" in out
    assert (results / "lora_dit.lora.safetensors").is_file()
    assert not (results / "lora_dit.pth").exists()  # the frozen base is not exported
    assert (results / "samples.png").stat().st_size > 0


def test_latent_dit_without_autoencoder_says_what_to_run(tmp_path):
    """Cheap, no launch: build() fails with the command that writes the checkpoint."""
    DigitsAutoencoder = load_entry(str(RECIPES / "digits_autoencoder.py")).DigitsAutoencoder
    with pytest.raises(
        ValueError, match=re.escape("litegen launch recipes/digits_autoencoder.yaml")
    ):
        DigitsAutoencoder.from_checkpoint(tmp_path / "missing.pth")


# -- the GPU recipes, tiny, on the CPU ---------------------------------------------------------
# What turns a GPU recipe into a CPU smoke run: no bf16 preset, compile or fused AdamW.
CPU = [
    "runtime.device=cpu",
    "optimization.precision.preset=null",
    "optimization.compile.enabled=false",
    "optimization.optimizer.backend=foreach",
    "num_workers=0",
    "pin_memory=false",
    "trainer.checkpoint_every=0",
    "trainer.log_every=2",
    "max_steps=4",
    "global_batch_size=4",
]
TINY = {
    # Two latent sizes: a batch that mixed them would not even stack.
    "dit_synthetic": ("dit_imagenet.yaml", ["model.size=tiny", "data.latent_sizes=[4,8]",
                                            "data.synthetic_samples=32"]),
    "dit_images": ("dit_imagenet.yaml", ["model.size=tiny", "data.resolution=16"]),
    "wan": ("wan_video.yaml", ["model.size=tiny", "data.frames=2", "data.height=4",
                               "data.width=4", "data.text_tokens=6", "data.prompts=4",
                               "data.synthetic_samples=16",
                               "optimization.memory.activation_checkpoint.selective_ratio=0.5"]),
}  # fmt: skip


def train_gpu_recipes(root: str, extras: dict[str, list[str]]) -> dict[str, list[float]]:
    """Each tiny recipe through run_entry, as `litegen launch`'s workers run it."""
    from litegen.trainer import run_entry
    from litegen_cli.recipe import load_recipe

    losses = {}
    for name, (recipe, overrides) in TINY.items():
        extra = extras.get(name, [])
        recipe = load_recipe(
            RECIPES / recipe, [*CPU, *overrides, *extra, f"results_dir={root}/{name}"]
        )
        losses[name] = run_entry(recipe.config, recipe.launch.entry, recipe.base_dir)
    return losses


def image_folder_and_vae(root: Path) -> list[str]:
    """Two classes of small random images and a tiny diffusers VAE (factor 2, 4 channels)."""
    import numpy as np
    from diffusers import AutoencoderKL
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (root / "images" / label).mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / label / f"{i}.png")
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    vae.save_pretrained(root / "vae")
    return [
        f"data.image_folder={root / 'images'}",
        f"vae.path={root / 'vae'}",
        f"latent_cache.root={root / 'cache'}",
    ]


def test_gpu_recipes_run_tiny_on_the_cpu_and_export_diffusers_folders(tmp_path):
    """DiT-XL/2 and Wan 2.1 recipes at tiny sizes: synthetic bucketed latents, an image folder
    encoded by `litegen cache build`, synthetic video; each exports a diffusers folder.

    The synthetic DiT run is also the round trip of diffusers folders: it starts from a tiny
    DiT saved with ``save_pretrained`` (``init_from``), trains sharded by fsdp2 on 2 ranks, and
    its exported folder loads with ``from_pretrained`` holding exactly the EMA weights."""
    from diffusers import DiTTransformer2DModel, WanTransformer3DModel

    from litegen_cli.cache_build import build_recipe_cache
    from litegen_cli.recipe import load_recipe

    MODELS = load_entry(str(RECIPES / "dit_imagenet.py")).MODELS
    torch.manual_seed(1)
    source = DiTTransformer2DModel(**MODELS["tiny"])
    source.save_pretrained(tmp_path / "source")
    images = image_folder_and_vae(tmp_path)
    recipe = load_recipe(RECIPES / "dit_imagenet.yaml", [*CPU, *TINY["dit_images"][1], *images])
    report = build_recipe_cache(recipe)
    assert (report.samples, report.misses) == (8, 8)
    extras = {
        "dit_synthetic": [
            f"init_from={tmp_path / 'source'}",
            "optimization.parallel.strategy=fsdp2",
        ],
        "dit_images": images,
    }
    losses = run_ranks(train_gpu_recipes, 2, str(tmp_path), extras)[0]
    assert all(len(v) == 2 for v in losses.values()), losses
    for name, cls in (("dit_synthetic", DiTTransformer2DModel), ("dit_images", DiTTransformer2DModel),
                      ("wan", WanTransformer3DModel)):  # fmt: skip
        results = tmp_path / name
        exported = cls.from_pretrained(results / "diffusers")
        ema = torch.load(next(results.glob("*.ema.pth")), weights_only=True)
        assert exported.state_dict().keys() == ema.keys()
        assert all(torch.equal(t, ema[k]) for k, t in exported.state_dict().items()), name
    # init_from took the source's weights: 4 AdamW steps of lr 1e-4 moved them only a little.
    trained = torch.load(tmp_path / "dit_synthetic" / "dit_imagenet.pth", weights_only=True)
    moved = max((trained[k] - v).abs().max().item() for k, v in source.state_dict().items())
    assert 0 < moved < 2e-3
