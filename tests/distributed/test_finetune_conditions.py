"""Conditioned fine-tuning end to end on the CPU: Wan 2.1 image-to-video through `litegen
launch` (2 gloo ranks, ddp, LoRA and EMA) on clips with and without a first-frame image, a
validation sample from a first frame per prompt, and LoRA exports that diffusers'
WanImageToVideoPipeline loads; the conditions' mistakes refused before any rank starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from litegen_cli.app import app
from tests.media import make_media_folder, write_png
from tests.pipelines import tiny_pipeline_folder

pytest.importorskip("diffusers")
pytest.importorskip("av")
pytest.importorskip("peft")

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "finetune_video.yaml")
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four clips; two bring a first frame of their own, two start from their frame 0."""
    root = make_media_folder(tmp_path_factory.mktemp("media"), images=0, videos=4, frames=9)
    for i in (0, 1):
        write_png(root / "clips" / f"clip_{i}.image.png", 48, 32, color=(250, 20 * i, 0))
    return root


def overrides(tmp_path: Path, media: Path, first_frame: Path) -> list[str]:
    return [
        "runtime.device=cpu",
        "launch.nproc_per_node=2",
        "optimization.parallel.strategy=ddp",
        "optimization.precision.preset=null",
        "optimization.lora.target_modules=[to_q,to_k,to_v,to_out.0,add_k_proj,add_v_proj]",
        "global_batch_size=2",
        "max_steps=4",
        "trainer.sample_every=4",
        "trainer.checkpoint_every=0",
        "trainer.log_every=2",
        "trainer.validation.steps=2",
        "trainer.validation.height=32",
        "trainer.validation.width=32",
        "trainer.validation.frames=5",
        f"trainer.validation.conditions={{image: [{first_frame}]}}",
        f"finetune.pipeline={tiny_pipeline_folder('wan_i2v')}",
        f"finetune.data.folder={media}",
        "finetune.data.resolution=32",
        "finetune.data.max_frames=5",
        f"finetune.data.cache_root={tmp_path / 'cache'}",
        f"results_dir={tmp_path / 'results'}",
    ]


def i2v_output(transformer: torch.nn.Module) -> torch.Tensor:
    """The I2V transformer on one fixed input (512 text tokens, 17 CLIP tokens)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return transformer.eval()(
            torch.randn(1, 12, 2, 4, 4, generator=generator),
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=torch.randn(1, 512, 32, generator=generator),
            encoder_hidden_states_image=torch.randn(1, 17, 16, generator=generator),
            return_dict=False,
        )[0]


def test_wan_i2v_trains_samples_and_exports_through_litegen_launch(
    tmp_path: Path, media: Path
) -> None:
    from diffusers import WanImageToVideoPipeline
    from peft import PeftModel

    first_frame = write_png(tmp_path / "first.png", 32, 32, color=(0, 200, 100))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    args = [sys.executable, "-m", "litegen_cli.app", "launch", RECIPE,
            *overrides(tmp_path, media, first_frame)]  # fmt: skip
    try:
        proc = subprocess.run(
            args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the launch did not finish in {TIMEOUT_S}s:\n{str(err.output)[-4000:]}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = tmp_path / "results"
    assert (results / "samples" / "step_4" / "samples.mp4").is_file()

    # The EMA adapters through diffusers' loader (both file layouts) and through peft give
    # one transformer, and not the base one.
    pipeline = tiny_pipeline_folder("wan_i2v")
    base = i2v_output(WanImageToVideoPipeline.from_pretrained(pipeline).transformer)
    through_peft = i2v_output(
        PeftModel.from_pretrained(
            WanImageToVideoPipeline.from_pretrained(pipeline).transformer,
            str(results / "lora" / "finetune_video.ema.peft"),
        )
    )
    assert not torch.allclose(through_peft, base)
    for name in ("finetune_video.ema.lora.safetensors",
                 "finetune_video.ema.original.lora.safetensors"):  # fmt: skip
        pipe = WanImageToVideoPipeline.from_pretrained(pipeline)
        pipe.load_lora_weights(str(results / "lora" / name))
        torch.testing.assert_close(i2v_output(pipe.transformer), through_peft)


def exit_2(args: list[str]) -> str:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())


def test_condition_mistakes_are_refused_before_the_ranks_start(tmp_path: Path, media: Path) -> None:
    first_frame = write_png(tmp_path / "first.png", 32, 32)
    given = overrides(tmp_path, media, first_frame)
    without = [o for o in given if not o.startswith("trainer.validation.conditions")]
    refused = exit_2(["inspect-config", RECIPE, *without])
    assert ("field 'trainer.validation.conditions.image': WanImageToVideoPipeline samples with "
            "its image condition (the first frame the video starts from)") in refused  # fmt: skip
    two = [*without, f"trainer.validation.conditions={{image: [{first_frame}, {first_frame}]}}"]
    assert "1 prompt(s); give one file per prompt" in exit_2(["inspect-config", RECIPE, *two])
    # Wan text-to-video takes no first frame: the folder's image files are refused by name.
    t2v = [o for o in without if not o.startswith("finetune.pipeline")]
    refused = exit_2(["inspect-config", RECIPE, *t2v,
                      f"finetune.pipeline={tiny_pipeline_folder('wan')}"])  # fmt: skip
    assert "gives the condition(s) image (e.g. " in refused
    assert "but the model takes no condition files" in refused
    assert not (tmp_path / "results").exists()
