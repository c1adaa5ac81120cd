"""Wan 2.1 image-to-video (litegen.families.wan.WanI2V): the registry finds it, its first-frame
condition is what WanImageToVideoPipeline builds, its forward is the call written out by hand,
it samples from a first frame through the pipeline, and its LoRA exports reload in diffusers'
WanImageToVideoPipeline with the trained outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from litegen.config.sections import LoRAConfig
from litegen.families import family_for_pipeline, family_for_transformer
from litegen.families.wan import Wan, WanI2V, _to_pil
from litegen.finetune.export import write_export
from litegen.lora import apply_lora
from litegen.objectives import FlowMatching
from tests.pipelines import tiny_pipeline_folder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def pipe():
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(tiny_pipeline_folder("wan_i2v"))


def clips(n: int = 2, frames: int = 5) -> torch.Tensor:
    return torch.rand(n, 3, frames, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_the_registry_finds_it_and_shares_wan_s_transformer_parts() -> None:
    assert family_for_pipeline("WanImageToVideoPipeline") is WanI2V
    assert family_for_transformer("WanTransformer3DModel").original_keys is WanI2V.original_keys
    model = diffusers.WanTransformer3DModel(**WanI2V.tiny_config)
    assert model.config.in_channels == 3 * model.config.out_channels  # noise, mask + first frame
    assert WanI2V.sequence_plan(model) == Wan.sequence_plan(model)


def test_the_first_frame_condition_is_the_pipeline_s(pipe) -> None:
    clip = clips()
    first = clip[:, :, 0]
    with torch.no_grad():
        encoded = WanI2V().encode_condition(pipe, "image", first, clip, micro_batch_size=1)
        for i in range(2):  # the pipeline, one image at a time, as it samples
            _, condition = pipe.prepare_latents(
                first[i : i + 1], 1, 4, 32, 48, 5, torch.float32, torch.device("cpu")
            )
            torch.testing.assert_close(encoded["first_frame"][i : i + 1], condition)
            embeds = pipe.encode_image(_to_pil(first[i]), torch.device("cpu"))
            torch.testing.assert_close(encoded["image_embeds"][i : i + 1], embeds)
    assert encoded["first_frame"].shape == (2, 8, 2, 4, 6)  # 4 mask + 4 latent channels


def batch_of(pipe, clip: torch.Tensor) -> dict[str, torch.Tensor]:
    family = WanI2V()
    with torch.no_grad():
        batch = {
            "latents": family.encode_latents(pipe, clip, 2),
            "prompt_embeds": family.encode_text(pipe, ["a fox", "a cat"])["prompt_embeds"],
        }
        return batch | family.encode_condition(pipe, "image", clip[:, :, 0], clip, 2)


def test_predict_is_the_hand_written_call_and_trains_the_image_branch(pipe) -> None:
    model = diffusers.WanTransformer3DModel(**WanI2V.tiny_config)
    batch = batch_of(pipe, clips())
    noisy = torch.randn_like(batch["latents"])
    sigmas = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        got = WanI2V().predict(model, noisy, sigmas, batch)
        want = model(
            hidden_states=torch.cat([noisy, batch["first_frame"]], dim=1),
            timestep=torch.tensor([250.0, 750.0]),
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_hidden_states_image=batch["image_embeds"],
            return_dict=False,
        )[0]
    torch.testing.assert_close(got, want)
    assert got.shape == noisy.shape
    loss = WanI2V().loss(model, batch, FlowMatching())
    loss.backward()
    assert model.blocks[0].attn2.add_k_proj.weight.grad.abs().sum() > 0
    assert model.patch_embedding.weight.grad[:, 4:].abs().sum() > 0  # the condition channels


def test_it_samples_from_one_first_frame_per_prompt(pipe) -> None:
    from PIL import Image

    validation = type("V", (), {"height": 32, "width": 32, "steps": 2, "guidance": 1.0,
                                "frames": 5})()  # fmt: skip
    frames = [Image.new("RGB", (32, 32), color) for color in ((255, 0, 0), (0, 0, 255))]
    videos = WanI2V().sample(
        pipe, ["a", "b"], validation, torch.Generator().manual_seed(0), {"image": frames}
    )
    assert videos.shape == (2, 3, 5, 32, 32) and videos.min() >= 0 and videos.max() <= 1
    with pytest.raises(ValueError, match=r"give trainer\.validation\.conditions\.image"):
        WanI2V().sample(pipe, ["a"], validation, torch.Generator(), None)


def test_lora_exports_reload_in_diffusers_with_the_trained_outputs(pipe, tmp_path: Path) -> None:
    from diffusers import WanImageToVideoPipeline

    folder = tiny_pipeline_folder("wan_i2v")
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj"]
    trained = WanImageToVideoPipeline.from_pretrained(folder).transformer
    apply_lora(trained, LoRAConfig(rank=4, alpha=8, target_modules=targets))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    write_export(trained, trained.state_dict(), folder, tmp_path, name="run")
    batch = batch_of(pipe, clips())
    noisy, sigmas = torch.randn_like(batch["latents"]), torch.tensor([0.5, 0.5])

    def output(model) -> torch.Tensor:
        with torch.no_grad():
            return WanI2V().predict(model.eval(), noisy, sigmas, batch)

    want = output(trained)
    assert (
        want - output(WanImageToVideoPipeline.from_pretrained(folder).transformer)
    ).abs().max() > 1e-2
    for file in ("run.lora.safetensors", "run.original.lora.safetensors"):
        fresh = WanImageToVideoPipeline.from_pretrained(folder)
        fresh.load_lora_weights(str(tmp_path / file))
        torch.testing.assert_close(output(fresh.transformer), want, rtol=1e-5, atol=1e-5)
