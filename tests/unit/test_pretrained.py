"""Pipeline folders: checked before loading, loaded offline, every component frozen but the trained one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from litegen.pretrained import check_pipeline_folder, load_component, load_pipeline
from tests.pipelines import tiny_pipeline_folder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def wan() -> Path:
    return tiny_pipeline_folder("wan")


def test_the_folder_names_its_components(wan: Path) -> None:
    components = check_pipeline_folder(wan)
    assert components["transformer"] == ("diffusers", "WanTransformer3DModel")
    assert components["vae"] == ("diffusers", "AutoencoderKLWan")
    assert components["text_encoder"] == ("transformers", "UMT5EncoderModel")
    assert "transformer_2" not in components  # null in model_index.json: not a component


def test_bad_folders_name_the_path_and_the_fix(wan: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not exist: point finetune\.pipeline"):
        check_pipeline_folder(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"has no model_index\.json"):
        check_pipeline_folder(tmp_path)
    broken = shutil.copytree(wan, tmp_path / "broken")
    shutil.rmtree(broken / "vae")
    with pytest.raises(
        ValueError, match=rf"misses its 'vae' component \({broken / 'vae'} is missing\)"
    ):
        check_pipeline_folder(broken)
    with pytest.raises(ValueError, match="no component 'unet'"):
        load_component(wan, "unet")
    with pytest.raises(ValueError, match=r"trained=\['unet'\] are not components"):
        load_pipeline(wan, trained=["unet"])


def test_the_trained_component_learns_and_the_rest_is_frozen(wan: Path) -> None:
    pipe = load_pipeline(wan)
    assert all(p.requires_grad for p in pipe.transformer.parameters())
    for name in ("vae", "text_encoder"):
        module = getattr(pipe, name)
        assert not any(p.requires_grad for p in module.parameters()) and not module.training
    transformer = load_component(wan, "transformer")
    assert type(transformer).__name__ == "WanTransformer3DModel"
    for (name, ours), theirs in zip(
        transformer.state_dict().items(), pipe.transformer.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_a_component_in_memory_is_used_and_left_alone(wan: Path) -> None:
    model = load_component(wan, "transformer").train()
    pipe = load_pipeline(wan, trained=(), transformer=model)
    assert pipe.transformer is model and model.training
    assert all(p.requires_grad for p in model.parameters())
    assert not any(p.requires_grad for p in pipe.vae.parameters())


def test_the_tiny_pipeline_samples_videos_on_the_temporal_rule(wan: Path) -> None:
    pipe = load_pipeline(wan)
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (4, 8)
    frames = pipe(
        prompt="a red fox",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=2,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 9, 3, 32, 32)
    assert torch.isfinite(frames).all()
