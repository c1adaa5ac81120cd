"""Exports beside diffusers' layout: a LoRA run's original-format file, a full fine-tune's
pipeline folder whose frozen components are links to the source folder's (loaded by
``DiffusionPipeline.from_pretrained``, nothing big copied) and its transformer as one
original-format file (``litegen export --original``) read back by ``from_single_file``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

from litegen.config.sections import LoRAConfig
from litegen.families import KeyMap
from litegen.families.wan import ORIGINAL_KEYS as WAN_KEY_MAP
from litegen.families.wan import Wan
from litegen.finetune.export import write_export
from litegen.lora import adapter_alpha_state, apply_lora
from litegen.model_keys.original_format import lora_to_original
from litegen.pretrained import load_component
from litegen_cli.app import app
from tests.pipelines import tiny_pipeline_folder
from tests.unit.test_export import step_folder

pytest.importorskip("peft")


def trained_wan() -> nn.Module:
    """The tiny Wan transformer with weights that differ from the folder's."""
    transformer = load_component(tiny_pipeline_folder("wan"), "transformer")
    with torch.no_grad():
        for param in transformer.parameters():
            param.add_(0.01)
    return transformer


def test_a_lora_export_writes_the_original_format_beside_diffusers_and_peft(tmp_path):
    transformer = load_component(tiny_pipeline_folder("wan"), "transformer")
    apply_lora(transformer, LoRAConfig(rank=4, alpha=8, target_modules=["to_q", "to_v"]))
    state = transformer.state_dict()
    out = write_export(
        transformer, state, tiny_pipeline_folder("wan"), tmp_path / "lora", name="run"
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "run.lora.safetensors",
        "run.original.lora.safetensors",
        "run.peft",
    ]
    written = load_file(out / "run.original.lora.safetensors")
    want = lora_to_original(adapter_alpha_state(transformer, state), WAN_KEY_MAP)
    assert written.keys() == want.keys()
    assert all(torch.equal(written[k], want[k]) for k in want)


def test_adapters_the_original_lacks_leave_the_diffusers_files_and_a_warning(
    tmp_path, caplog, monkeypatch
):
    only_q = KeyMap(modules={"blocks.{i}.self_attn.q": ("blocks.{i}.attn1.to_q",)})
    monkeypatch.setattr(Wan, "original_keys", only_q)
    transformer = load_component(tiny_pipeline_folder("wan"), "transformer")
    apply_lora(transformer, LoRAConfig(rank=2, target_modules=["to_q", "to_k"]))
    out = write_export(transformer, transformer.state_dict(), tiny_pipeline_folder("wan"),
                       tmp_path / "lora", name="run")  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["run.lora.safetensors", "run.peft"]
    assert "no module for the LoRA of blocks.0.attn1.to_k" in caplog.text


def test_a_full_export_links_the_frozen_components_and_loads(tmp_path):
    from diffusers import DiffusionPipeline, WanTransformer3DModel

    source = tiny_pipeline_folder("wan")
    transformer = trained_wan()
    state = transformer.state_dict()
    out = write_export(transformer, state, source, tmp_path / "pipeline", name="ft", original=True)

    frozen = sorted(p.name for p in source.iterdir() if p.is_dir() and p.name != "transformer")
    assert frozen  # text_encoder, tokenizer, vae, scheduler
    for name in frozen:
        assert (out / name).is_symlink() and (out / name).resolve() == (source / name).resolve()
    assert not (out / "transformer").is_symlink()
    copied = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.suffix == ".json")
    assert copied < 4096  # model_index.json: the frozen weights were not copied

    pipe = DiffusionPipeline.from_pretrained(out)
    assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in state.items())
    original = DiffusionPipeline.from_pretrained(source)
    encoder, source_encoder = pipe.text_encoder.state_dict(), original.text_encoder.state_dict()
    assert all(torch.equal(encoder[k], source_encoder[k]) for k in source_encoder)

    single = WanTransformer3DModel.from_single_file(
        str(out / "ft.original.safetensors"), config=str(out / "transformer"), local_files_only=True
    )
    assert all(torch.equal(single.state_dict()[k], v) for k, v in state.items())

    # A second export onto the first removes the old folder's links, never what they point to.
    write_export(transformer, state, source, out, name="ft")
    assert all(any((source / name).iterdir()) for name in frozen)
    assert not (out / "ft.original.safetensors").exists()


def test_an_unknown_original_layout_is_refused_before_anything_is_written(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no original checkpoint layout for Linear"):
        write_export(model, model.state_dict(), tiny_pipeline_folder("wan"), tmp_path / "p",
                     name="ft", original=True)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_litegen_export_original_writes_the_single_file(tmp_path):
    transformer = trained_wan()
    state = {"model": transformer.state_dict()}
    config = {"exp_name": "ft", "model": {"pretrained": str(tiny_pipeline_folder("wan"))}}
    step_folder(tmp_path, config, state)
    out = tmp_path / "exported"
    command = ["export", "--from", str(tmp_path), "--out", str(out), "--original"]
    result = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    written = load_file(out / "ft.original.safetensors")
    assert torch.equal(
        written["blocks.0.self_attn.q.weight"], state["model"]["blocks.0.attn1.to_q.weight"]
    )
    assert (out / "vae").is_symlink()
