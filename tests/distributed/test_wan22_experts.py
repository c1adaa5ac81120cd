"""Wan 2.2 A14B's two experts through `litegen.finetune` on the CPU: 2 gloo ranks with LoRA and
EMA train both experts in one run (each step its expert, the same on every rank), sample through
the two-expert pipeline, and export one LoRA per expert that diffusers loads into that expert; a
bad ``finetune.experts`` is refused before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from litegen.finetune.expert_models import ExpertSchedule
from litegen.objectives import FlowMatching
from litegen_cli.app import app
from tests.distributed.harness import run_ranks
from tests.distributed.test_finetune_recipes import RECIPES, SHORT, train_recipe
from tests.media import make_media_folder
from tests.pipelines import tiny_pipeline_folder

pytest.importorskip("diffusers")
pytest.importorskip("av")
pytest.importorskip("peft")


def expert_output(transformer: torch.nn.Module, timestep: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 3, 4, 4, generator=generator)
    text = torch.randn(1, 32, 32, generator=generator)
    with torch.no_grad():
        return transformer(latents, timestep=torch.tensor([timestep]), encoder_hidden_states=text,
                           return_dict=False)[0]  # fmt: skip


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_both_experts_train_in_one_run_and_export_one_lora_each(
    tmp_path: Path, strategy: str
) -> None:
    from diffusers import WanPipeline

    media = make_media_folder(tmp_path / "media", images=2, videos=2, frames=5)
    pipeline = tiny_pipeline_folder("wan22")
    results = tmp_path / "results"
    overrides = [*SHORT, f"finetune.pipeline={pipeline}", f"finetune.data.folder={media}",
                 f"finetune.data.cache_root={tmp_path / 'cache'}", f"results_dir={results}",
                 "finetune.data.max_frames=5", "trainer.validation.frames=5", "global_seed=0",
                 f"optimization.parallel.strategy={strategy}", "trainer.checkpoint_every=4"]  # fmt: skip
    losses = run_ranks(train_recipe, 2, "finetune_video.yaml", overrides)[0]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert (results / "samples" / "step_4" / "samples.mp4").is_file()

    # Steps 1-4 of global seed 0 draw the high-noise expert, then the low-noise one.
    objective = FlowMatching(density="logit_normal", shift=3.0)
    drawn = {ExpertSchedule(0.875, ("high", "low"), 0).expert_at(s, objective) for s in range(1, 5)}
    assert drawn == {"high", "low"}

    lora = results / "lora"
    base = WanPipeline.from_pretrained(pipeline)
    pipe = WanPipeline.from_pretrained(pipeline)
    pipe.load_lora_weights(str(lora / "finetune_video.ema.high_noise.lora.safetensors"))
    pipe.load_lora_weights(str(lora / "finetune_video.ema.low_noise.lora.safetensors"),
                           load_into_transformer_2=True)  # fmt: skip
    for component, timestep in (("transformer", 950.0), ("transformer_2", 300.0)):
        trained = expert_output(getattr(pipe, component), timestep)
        assert not torch.allclose(trained, expert_output(getattr(base, component), timestep))
    original = load_file(lora / "finetune_video.ema.low_noise.original.lora.safetensors")
    assert all(key.startswith("diffusion_model.blocks.") for key in original)

    # `litegen export` from the last checkpoint writes the same files per expert.
    exported = CliRunner().invoke(app, ["export", "--from", str(results)])
    assert exported.exit_code == 0, exported.output
    for expert in ("high_noise", "low_noise"):
        for kind in ("lora", "original.lora"):
            file = f"finetune_video.ema.{expert}.{kind}.safetensors"
            want, got = load_file(lora / file), load_file(results / "exports" / "step_4" / file)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_bad_expert_name_is_refused_before_the_ranks_start(tmp_path: Path) -> None:
    media = make_media_folder(tmp_path / "media", images=2, videos=0, frames=5)
    results = tmp_path / "results"
    base = [str(RECIPES / "finetune_video.yaml"), "launch.nproc_per_node=2",
            f"finetune.data.folder={media}", f"results_dir={results}"]  # fmt: skip
    cases = {
        (
            "wan22",
            "finetune.experts=[middle]",
        ): "finetune.experts.0': Input should be 'high' or 'low'",
        ("wan", "finetune.experts=[low]"): "field 'finetune.experts': ['low'] names experts, but",
    }
    for (family, experts), message in cases.items():
        args = ["launch", *base, f"finetune.pipeline={tiny_pipeline_folder(family)}", experts]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
        assert result.exit_code == 2, result.output
        assert message in result.output.replace("\n", ""), result.output
    assert not results.exists()  # no run folder claimed: no rank started


def test_ti2v_trains_image_to_video_from_companion_first_frames(tmp_path: Path) -> None:
    """Wan 2.2 TI2V-5B's tiny pipeline, each clip with its first frame as `<stem>.image.png`:
    2 ranks under ddp with LoRA and EMA, an image-to-video validation sample, LoRA exports."""
    from tests.media import write_png

    media = make_media_folder(tmp_path / "media", images=0, videos=2, frames=5)
    for clip in sorted((media / "clips").glob("*.mp4")):
        write_png(clip.with_suffix(".image.png"), 48, 32)
    first = write_png(tmp_path / "first.png", 32, 32)
    results = tmp_path / "results"
    overrides = [*SHORT, f"finetune.pipeline={tiny_pipeline_folder('wan22_ti2v')}",
                 f"finetune.data.folder={media}", f"finetune.data.cache_root={tmp_path / 'cache'}",
                 f"results_dir={results}", "finetune.data.max_frames=5",
                 "trainer.validation.frames=5", f"trainer.validation.conditions.image=[{first}]",
                 "optimization.parallel.strategy=ddp"]  # fmt: skip
    losses = run_ranks(train_recipe, 2, "finetune_video.yaml", overrides)[0]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert (results / "samples" / "step_4" / "samples.mp4").is_file()
    adapters = load_file(results / "lora" / "finetune_video.ema.lora.safetensors")
    assert any(value.abs().sum() > 0 for key, value in adapters.items() if "lora_B" in key)


def test_a_two_expert_run_resumes_exactly(tmp_path: Path) -> None:
    """Global seed 1 trains low, high, high, low: the resumed half draws the same experts and
    the same noise, so its losses are those of the straight run."""
    objective = FlowMatching(density="logit_normal", shift=3.0)
    schedule = ExpertSchedule(0.875, ("high", "low"), seed=1)
    assert [schedule.expert_at(s, objective) for s in range(1, 5)] == ["low", "high", "high", "low"]
    media = make_media_folder(tmp_path / "media", images=2, videos=2, frames=5)
    common = [*SHORT, f"finetune.pipeline={tiny_pipeline_folder('wan22')}",
              f"finetune.data.folder={media}", f"finetune.data.cache_root={tmp_path / 'cache'}",
              "finetune.data.max_frames=5", "global_seed=1", "trainer.sample_every=0",
              "trainer.log_every=1", "optimization.parallel.strategy=ddp"]  # fmt: skip
    straight = run_ranks(train_recipe, 2, "finetune_video.yaml",
                         [*common, f"results_dir={tmp_path / 'a'}"])[0]  # fmt: skip
    run = tmp_path / "b"
    first = run_ranks(train_recipe, 2, "finetune_video.yaml",
                      [*common, f"results_dir={run}", "max_steps=2", "trainer.checkpoint_every=2"])[0]  # fmt: skip
    resumed = run_ranks(train_recipe, 2, "finetune_video.yaml",
                        [*common, f"results_dir={run}", f"trainer.resume_run={run}"])[0]  # fmt: skip
    assert len(straight) == 4
    assert first + resumed == straight


def test_i2v_a14b_trains_both_experts_from_first_frames(tmp_path: Path) -> None:
    """Wan 2.2 I2V-A14B's tiny pipeline: the clips' frame 0 as the image, 2 ranks under ddp
    with LoRA and EMA, an image-to-video sample through both experts, one LoRA per expert."""
    from tests.media import write_png

    objective = FlowMatching(density="logit_normal", shift=3.0)
    schedule = ExpertSchedule(0.9, ("high", "low"), seed=1)  # I2V-A14B's boundary
    assert [schedule.expert_at(s, objective) for s in range(1, 5)] == ["low", "high", "low", "low"]
    media = make_media_folder(tmp_path / "media", images=0, videos=2, frames=5)
    first = write_png(tmp_path / "first.png", 32, 32)
    results = tmp_path / "results"
    overrides = [*SHORT, f"finetune.pipeline={tiny_pipeline_folder('wan22_i2v')}",
                 f"finetune.data.folder={media}", f"finetune.data.cache_root={tmp_path / 'cache'}",
                 f"results_dir={results}", "finetune.data.max_frames=5", "global_seed=1",
                 "trainer.validation.frames=5", f"trainer.validation.conditions.image=[{first}]",
                 "optimization.parallel.strategy=ddp"]  # fmt: skip
    losses = run_ranks(train_recipe, 2, "finetune_video.yaml", overrides)[0]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert (results / "samples" / "step_4" / "samples.mp4").is_file()
    for expert in ("high_noise", "low_noise"):
        adapters = load_file(results / "lora" / f"finetune_video.ema.{expert}.lora.safetensors")
        assert any(value.abs().sum() > 0 for key, value in adapters.items() if "lora_B" in key)
