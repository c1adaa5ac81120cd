"""A trained LoRA, exported, reloads exactly through diffusers' pipeline loader, the model's
``load_lora_adapter`` and a peft folder (``PeftModel.from_pretrained``)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import litegen
from litegen.utils.config import MainConfig
from tests.distributed.models import WAN_TARGETS, WanDataset, make_wan, wan_loss

peft = pytest.importorskip("peft")


@torch.no_grad()
def outputs(model: torch.nn.Module) -> torch.Tensor:
    inputs, _ = WanDataset(4, seed=1)[:]
    return model.eval()(*inputs, return_dict=False)[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Wan transformer whose rank-4, alpha-8 adapters (scale 2) trained for 3 steps."""
    folder = tmp_path_factory.mktemp("lora")
    config = {
        "runtime": {"device": "cpu"},
        "results_dir": str(folder),
        "exp_name": "run",
        "global_batch_size": 4,
        "max_steps": 3,
        "optimization": {"lora": {"rank": 4, "alpha": 8, "target_modules": WAN_TARGETS}},
    }
    gen = litegen.initialize(MainConfig.from_dict(config))
    model = make_wan()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = gen.prepare(model, optimizer, WanDataset())
    for batch in loader:
        wan_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    files = {"file": gen.save_model(), "folder": gen.save_lora_peft()}
    result = {"want": outputs(gen.unwrap(model)), "base": outputs(make_wan()), **files}
    torch.distributed.destroy_process_group()
    return result


def test_the_adapters_trained(trained):
    assert not torch.allclose(trained["want"], trained["base"], atol=1e-4)


def test_diffusers_pipeline_loader_is_exact(trained):
    from diffusers.loaders import WanLoraLoaderMixin

    model = make_wan()
    state, metadata = WanLoraLoaderMixin.lora_state_dict(
        str(trained["file"]), return_lora_metadata=True
    )
    WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=model, metadata=metadata)
    torch.testing.assert_close(outputs(model), trained["want"], rtol=0, atol=1e-6)


def test_the_models_load_lora_adapter_is_exact(trained):
    model = make_wan()
    model.load_lora_adapter(str(trained["file"]), prefix="transformer")
    torch.testing.assert_close(outputs(model), trained["want"], rtol=0, atol=1e-6)


def test_a_peft_folder_loads_with_peft_model_from_pretrained(trained):
    assert sorted(p.name for p in trained["folder"].iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    model = peft.PeftModel.from_pretrained(make_wan(), str(trained["folder"]))
    assert model.peft_config["default"].lora_alpha == 8  # the true alpha, as trained
    torch.testing.assert_close(outputs(model), trained["want"], rtol=0, atol=1e-6)


def test_the_loading_code_docs_lora_md_shows(trained, tmp_path, monkeypatch):
    """lora.md's two blocks, run as written: a pipeline whose ``from_pretrained`` gives a
    transformer of the trained shape (no hub download here), then ``PeftModel``."""
    from diffusers.loaders import WanLoraLoaderMixin

    from tests.unit.test_doc_snippets import blocks

    class WanPipeline(WanLoraLoaderMixin):
        hf_device_map = None  # no offloading
        components: ClassVar[dict] = {}

        @classmethod
        def from_pretrained(cls, *args):
            pipe = cls()
            pipe.transformer = make_wan()
            return pipe

    run = tmp_path / "results" / "run"
    run.mkdir(parents=True)
    for name in ("run.ema.lora.safetensors", "run.lora.safetensors"):
        (run / name).symlink_to(trained["file"])
    (run / "run.peft").symlink_to(trained["folder"])
    monkeypatch.chdir(tmp_path)
    diffusers_code, peft_code = blocks("lora.md", "## Files", "python")
    space = {"WanPipeline": WanPipeline, "transformer": make_wan(), "base_model": make_wan()}
    exec(compile(diffusers_code, "lora.md", "exec"), space)
    exec(compile(peft_code, "lora.md", "exec"), space)
    for model in (space["pipe"].transformer, space["transformer"], space["model"]):
        torch.testing.assert_close(outputs(model), trained["want"], rtol=0, atol=1e-6)
