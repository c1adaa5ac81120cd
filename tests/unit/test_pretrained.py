"""Pipeline folders: checked before loading, loaded offline, every component frozen but the trained one."""

from __future__ import annotations

import json
import os
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


def _damaged(wan: Path, tmp_path: Path, damage) -> Path:
    folder = shutil.copytree(wan, tmp_path / "damaged")
    damage(folder)
    return folder


def _zero_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:64] = bytes(64)  # same size, header gone
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            lambda f: (f / "vae" / "diffusion_pytorch_model.safetensors").unlink(),
            r"the 'vae' component has no weights file in .*/vae",
        ),
        (
            lambda f: _zero_header(f / "transformer" / "diffusion_pytorch_model.safetensors"),
            r"damaged weights file .*transformer/diffusion_pytorch_model\.safetensors \(its "
            r"header length 0",
        ),
        (
            lambda f: os.truncate(f / "text_encoder" / "model.safetensors", 40_000),
            r"damaged weights file .*text_encoder/model\.safetensors \(.*\(truncated\)",
        ),
    ],
    ids=["missing", "zeroed", "truncated"],
)
def test_damaged_weights_files_are_named_before_loading(wan, tmp_path, damage, expected):
    assert check_pipeline_folder(wan)  # the intact folder passes
    folder = _damaged(wan, tmp_path, damage)
    with pytest.raises(ValueError, match=expected) as err:
        check_pipeline_folder(folder)
    assert "Copy that subfolder again" in str(err.value)


def test_sharded_weights_are_checked_through_their_index(tmp_path):
    from safetensors.torch import save_file

    from litegen.pretrained import weights_problem

    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.ones(4)}, str(tmp_path / "m-00001-of-00002.safetensors"))
    index = {
        "weight_map": {"a": "m-00001-of-00002.safetensors", "b": "m-00002-of-00002.safetensors"}
    }
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps(index))
    assert "misses the weights file" in weights_problem(tmp_path)
    assert "m-00002-of-00002.safetensors, which m.safetensors.index.json lists" in weights_problem(
        tmp_path
    )
    save_file({"b": torch.ones(4)}, str(tmp_path / "m-00002-of-00002.safetensors"))
    assert weights_problem(tmp_path) is None


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


def test_a_component_of_another_library_is_not_imported(wan: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(wan, tmp_path / "odd")
    index = json.loads((folder / "model_index.json").read_text())
    index["transformer"] = ["json", "JSONDecoder"]  # any installed module could be named
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"library 'json'; LiteGen loads components of"):
        load_component(folder, "transformer")
