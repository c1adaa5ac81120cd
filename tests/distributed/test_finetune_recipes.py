"""The fine-tuning recipes end to end on the CPU: a tiny pipeline folder and a media folder the
test makes, the cache built once, 2 gloo ranks under fsdp2 with EMA, samples, and exports that
plain diffusers loads. The video recipe fills its cache with `litegen cache build` and trains
LoRA adapters; the image recipe fills its cache from the ranks and trains the whole transformer.
The ranks are forked (run_entry, as `litegen launch`'s workers run it): test_recipes.py covers
the launcher itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from litegen.finetune.training import CaptionDropout
from litegen_cli.app import app
from tests.distributed.harness import run_ranks
from tests.media import make_media_folder
from tests.pipelines import tiny_pipeline_folder

pytest.importorskip("diffusers")
pytest.importorskip("av")
pytest.importorskip("peft")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DOC = RECIPES.parent / "docs" / "finetune.md"
# A short run at the tiny pipeline's size: two samples of 32x32 per step, one sample at the end.
SHORT = [
    "runtime.device=cpu",
    "launch.nproc_per_node=2",
    "optimization.precision.preset=null",
    "global_batch_size=2",
    "max_steps=4",
    "trainer.sample_every=4",
    "trainer.checkpoint_every=0",
    "trainer.log_every=2",
    "finetune.data.resolution=32",
    "trainer.validation.steps=2",
    "trainer.validation.height=32",
    "trainer.validation.width=32",
]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_media_folder(tmp_path_factory.mktemp("media"), images=2, videos=4, frames=9)
    (root / "clips" / "broken.mp4").write_bytes(b"not a video")
    (root / "clips" / "broken.txt").write_text("a clip that cannot be read")
    return root


def shard_indexes(cache_root: Path) -> set[str]:
    return {p.relative_to(cache_root).as_posix() for p in cache_root.glob("*/*.json")}


def transformer_output(transformer: torch.nn.Module) -> torch.Tensor:
    """The transformer on one fixed input: what the exports must agree on."""
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 3, 4, 4, generator=generator)
    text = torch.randn(1, 32, 32, generator=generator)
    with torch.no_grad():
        return transformer(latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                           return_dict=False)[0]  # fmt: skip


def train_recipe(name: str, overrides: list[str]) -> list[float]:
    from litegen.trainer import run_entry
    from litegen_cli.recipe import load_recipe

    recipe = load_recipe(RECIPES / name, overrides)
    return run_entry(recipe.config, recipe.launch.entry, recipe.base_dir)


def test_video_recipe_cache_build_then_train_with_lora(
    tmp_path: Path, media: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import WanPipeline
    from peft import PeftModel

    pipeline = tiny_pipeline_folder("wan")
    cache_root, results = tmp_path / "cache", tmp_path / "results" / "finetune_video"
    overrides = [*SHORT, f"finetune.pipeline={pipeline}", f"finetune.data.folder={media}",
                 f"finetune.data.cache_root={cache_root}", f"results_dir={results}", "finetune.data.max_frames=9",
                 "trainer.validation.frames=9", "trainer.checkpoint_every=4"]  # fmt: skip
    recipe = str(RECIPES / "finetune_video.yaml")

    built = CliRunner().invoke(
        app, ["cache", "build", recipe, *overrides, "--nproc", "1"], env={"COLUMNS": "250"}
    )
    assert built.exit_code == 0, built.output
    # 6 files (the broken clip is skipped) and the empty caption, for caption dropout.
    assert re.search(r"misses \(encoded now\)\s*│\s*7\s*│", built.output)
    shards = shard_indexes(cache_root)
    assert len(shards) == 1

    losses = run_ranks(train_recipe, 2, "finetune_video.yaml", overrides)[0]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert shard_indexes(cache_root) == shards  # training read the cache and encoded nothing
    assert (results / "samples" / "step_4" / "samples.mp4").is_file()

    # The end-of-run export and `litegen export` from the last checkpoint write the EMA
    # adapters the final checkpoint file holds.
    exported = CliRunner().invoke(app, ["export", "--from", str(results)])
    assert exported.exit_code == 0, exported.output
    final = load_file(results / "finetune_video.ema.lora.safetensors")
    for folder in (results / "lora", results / "exports" / "step_4"):
        adapters = load_file(folder / "finetune_video.ema.lora.safetensors")
        assert adapters.keys() == final.keys()
        assert all(torch.equal(adapters[k], final[k]) for k in final)

    # The EMA adapters through diffusers' loader and through peft give the same transformer,
    # and it is not the base one.
    base = transformer_output(WanPipeline.from_pretrained(pipeline).transformer)
    pipe = WanPipeline.from_pretrained(pipeline)
    pipe.load_lora_weights(
        str(results / "exports" / "step_4" / "finetune_video.ema.lora.safetensors")
    )
    through_diffusers = transformer_output(pipe.transformer)
    base_model = WanPipeline.from_pretrained(pipeline).transformer
    through_peft = transformer_output(
        PeftModel.from_pretrained(base_model, str(results / "lora" / "finetune_video.ema.peft"))
    )
    torch.testing.assert_close(through_diffusers, through_peft)
    assert not torch.allclose(through_diffusers, base)

    # docs/finetune.md's loading code, as written, from the folder it names.
    (tmp_path / "tiny_wan").symlink_to(pipeline)
    monkeypatch.chdir(tmp_path)
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text().split("\n## Recipes")[1], re.S)
    exec(compile(code, "finetune.md", "exec"), {})


def test_image_recipe_full_fine_tuning_exports_a_pipeline(tmp_path: Path, media: Path) -> None:
    from diffusers import DiffusionPipeline
    from PIL import Image

    pipeline = tiny_pipeline_folder("flux")
    cache_root, results = tmp_path / "cache", tmp_path / "results"
    overrides = [*SHORT, f"finetune.pipeline={pipeline}", f"finetune.data.folder={media}",
                 f"finetune.data.cache_root={cache_root}", f"results_dir={results}",
                 "optimization.lora=null", "finetune.data.caption_dropout=0.5",
                 "trainer.checkpoint_every=2", "trainer.sample_every=2"]  # fmt: skip
    losses = run_ranks(train_recipe, 2, "finetune_image.yaml", overrides)[0]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert len(shard_indexes(cache_root)) == 2  # the ranks encoded half the files each
    assert (results / "samples" / "step_4" / "samples.png").is_file()

    exported = DiffusionPipeline.from_pretrained(results / "pipeline")
    ema = torch.load(results / "finetune_image.ema.pth", weights_only=True)
    state = exported.transformer.state_dict()
    assert state.keys() == ema.keys()
    assert all(torch.equal(t, ema[k]) for k, t in state.items())

    # `litegen export` from the step-2 checkpoint, in plain diffusers, draws the step-2 sample.
    out = tmp_path / "step_2_pipeline"
    result = CliRunner().invoke(
        app, ["export", "--from", str(results / "step_2"), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    at_step_2 = DiffusionPipeline.from_pretrained(out)
    image = at_step_2(prompt="a photo of a red fox in the snow", height=32, width=32,
                      num_inference_steps=2, guidance_scale=3.5,
                      max_sequence_length=min(exported.tokenizer_2.model_max_length, 512),
                      generator=torch.Generator().manual_seed(0), output_type="pt").images[0]  # fmt: skip
    with Image.open(results / "samples" / "step_2" / "samples.png") as png:
        sampled = torch.from_numpy(np.array(png)[2:34, 2:34]).permute(2, 0, 1) / 255
    torch.testing.assert_close(image, sampled, atol=1 / 255, rtol=0)
    assert not torch.equal(
        at_step_2.transformer.x_embedder.weight, exported.transformer.x_embedder.weight
    )
    again = CliRunner().invoke(
        app, ["export", "--from", str(results / "step_2"), "--out", str(out)]
    )
    assert again.exit_code == 2 and "already exists" in again.output


def test_caption_dropout_swaps_whole_samples_for_the_empty_caption() -> None:
    batch = {"latents": torch.randn(4000, 2), "prompt_embeds": torch.ones(4000, 3, 2),
             "pooled": torch.ones(4000, 2)}  # fmt: skip
    empty = {"prompt_embeds": torch.zeros(3, 2), "pooled": torch.zeros(2)}
    assert CaptionDropout(0.0, empty)(batch) is batch
    torch.manual_seed(0)
    out = CaptionDropout(0.25, empty)(batch)
    dropped = out["prompt_embeds"].sum(dim=(1, 2)) == 0
    assert torch.equal(dropped, out["pooled"].sum(dim=1) == 0)  # text and pooled together
    assert (out["prompt_embeds"][~dropped] == 1).all() and torch.equal(
        out["latents"], batch["latents"]
    )
    assert 0.22 < dropped.float().mean() < 0.28


def test_bad_folders_exit_2_naming_the_path(tmp_path: Path, media: Path) -> None:
    import json
    import shutil

    recipe = str(RECIPES / "finetune_video.yaml")
    wan = tiny_pipeline_folder("wan")

    def cache_build(pipeline: Path, folder: Path) -> str:
        args = [
            "cache",
            "build",
            recipe,
            f"finetune.pipeline={pipeline}",
            f"finetune.data.folder={folder}",
        ]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
        assert result.exit_code == 2, result.output
        return result.output.replace("\n", "")

    no_vae = shutil.copytree(wan, tmp_path / "no_vae")
    shutil.rmtree(no_vae / "vae")
    assert "misses its 'vae' component" in cache_build(no_vae, media)
    other = shutil.copytree(wan, tmp_path / "other")
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "CogVideoXPipeline"})
    )
    refused = cache_build(other, media)
    assert "is a CogVideoXPipeline: no model family trains a CogVideoXPipeline" in refused
    flat = " ".join(refused.replace("│", " ").split())  # the panel wraps the message
    assert "the families are flux (FluxPipeline)," in flat
    assert "wan (WanPipeline)" in flat
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no images" in cache_build(wan, empty)


def test_launch_and_inspect_config_refuse_bad_folders_before_the_ranks_start(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    results = tmp_path / "results"
    for command in ("inspect-config", "launch"):
        args = [command, str(RECIPES / "finetune_video.yaml"), "launch.nproc_per_node=1",
                f"finetune.pipeline={tiny_pipeline_folder('wan')}", f"finetune.data.folder={empty}",
                f"results_dir={results}"]  # fmt: skip
        result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
        assert result.exit_code == 2, result.output
        assert f"media folder {empty} holds no images" in result.output.replace("\n", "")
    assert not results.exists()  # no run folder claimed: no rank started


def test_the_entry_check_refuses_bad_folders_before_anything_is_built(
    tmp_path: Path, media: Path
) -> None:
    import shutil

    from litegen.entry import check_inputs
    from litegen_cli.recipe import load_recipe

    wan = tiny_pipeline_folder("wan")
    no_vae = shutil.copytree(wan, tmp_path / "no_vae")
    shutil.rmtree(no_vae / "vae")
    empty = tmp_path / "empty"
    (empty / "captions").mkdir(parents=True)
    (empty / "captions" / "fox.txt").write_text("a caption without its media")

    def check(pipeline: Path, folder: Path) -> None:
        overrides = [f"finetune.pipeline={pipeline}", f"finetune.data.folder={folder}",
                     "global_batch_size=2"]  # fmt: skip
        recipe = load_recipe(RECIPES / "finetune_video.yaml", overrides)
        check_inputs(recipe.config, recipe.launch.entry, recipe.base_dir)

    check(wan, media)
    with pytest.raises(ValueError, match=rf"{no_vae} misses its 'vae' component"):
        check(no_vae, media)
    with pytest.raises(ValueError, match=rf"media folder {empty} holds no images"):
        check(wan, empty)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_video_recipe_samples_under_sequence_parallel(tmp_path: Path, media: Path) -> None:
    """Two ranks split each clip's tokens (sp_size 2): training and sampling run on both."""
    pipeline = tiny_pipeline_folder("wan")
    results = tmp_path / "results"
    overrides = [*SHORT, f"finetune.pipeline={pipeline}", f"finetune.data.folder={media}",
                 f"finetune.data.cache_root={tmp_path / 'cache'}", f"results_dir={results}",
                 "finetune.data.max_frames=9", "trainer.validation.frames=9", "optimization.parallel.sp_size=2",
                 "global_batch_size=1", "trainer.sample_every=2"]  # fmt: skip
    losses = run_ranks(train_recipe, 2, "finetune_video.yaml", overrides)
    assert losses[0] == losses[1] and all(torch.isfinite(torch.tensor(losses[0])))
    for step in (2, 4):
        assert (results / "samples" / f"step_{step}" / "samples.mp4").is_file()
