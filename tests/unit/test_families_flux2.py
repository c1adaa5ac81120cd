"""The Flux.2 family checked against Flux2Pipeline's own code: its latents are the pipeline's
(un-patchified), its text embedding is ``encode_prompt``'s, its training forward is the
pipeline's transformer call, its shift is the pipeline's, its samples come from the pipeline,
and its original-format LoRA loads through ``Flux2Pipeline.load_lora_weights`` as trained."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from litegen.families import family_for_pipeline, family_for_transformer
from litegen.families.flux2 import ORIGINAL_KEYS, Flux2, latent_ids
from litegen.pretrained import load_component
from tests.pipelines import tiny_pipeline_folder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def pipe():
    from diffusers import Flux2Pipeline

    return Flux2Pipeline.from_pretrained(tiny_pipeline_folder("flux2"))


def tiny_transformer():
    return load_component(tiny_pipeline_folder("flux2"), "transformer")


def test_the_registry_finds_flux2_by_pipeline_and_transformer():
    assert family_for_pipeline("Flux2Pipeline") is Flux2
    assert family_for_transformer("Flux2Transformer2DModel") is Flux2


def test_latents_are_the_pipelines_un_patchified(pipe):
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ours = Flux2(pipe.scheduler.config).encode_latents(pipe, pixels, micro_batch_size=1)
    assert ours.shape == (2, 4, 4, 4)
    theirs = pipe._encode_vae_image(pixels, generator=None)  # patchified and normalised
    torch.testing.assert_close(pipe._patchify_latents(ours), theirs)
    assert not torch.allclose(pipe.vae.bn.running_var, torch.ones(16))  # statistics applied


def test_text_is_encode_prompts_at_the_tiny_encoders_layers(pipe):
    captions = ["a red fox", "a cat walking on a wooden table"]
    ours = Flux2().encode_text(pipe, captions)["prompt_embeds"]
    theirs, ids = pipe.encode_prompt(
        captions, max_sequence_length=64, text_encoder_out_layers=(1, 2, 3)
    )
    torch.testing.assert_close(ours, theirs)
    assert ours.shape == (2, 64, Flux2.tiny_config["joint_attention_dim"])
    assert ids[0, 5].tolist() == [0, 0, 0, 5]


def test_forward_is_the_pipelines_transformer_call(pipe):
    model = tiny_transformer()
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 8, 4, generator=generator)
    text = torch.randn(2, 6, 96, generator=generator)
    sigmas = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = Flux2().predict(model, latents, sigmas, {"prompt_embeds": text})
        patchified = pipe._patchify_latents(latents)
        tokens = model(
            hidden_states=pipe._pack_latents(patchified),
            encoder_hidden_states=text,
            timestep=sigmas,
            guidance=torch.ones(2),
            img_ids=pipe._prepare_latent_ids(patchified),
            txt_ids=pipe._prepare_text_ids(text),
            return_dict=False,
        )[0]
    ids = pipe._prepare_latent_ids(patchified)
    theirs = pipe._unpack_latents_with_ids(tokens, ids)
    torch.testing.assert_close(ours, pipe._unpatchify_latents(theirs))


def test_the_shift_is_the_pipelines_empirical_mu(pipe):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    family = Flux2(pipe.scheduler.config)
    for tokens in (16, 1024, 4096, 8192):
        assert family.shift_for(tokens) == pytest.approx(
            math.exp(compute_empirical_mu(tokens, 50)), rel=1e-9
        )
    assert Flux2({}).shift_for(1024) is None  # a scheduler without dynamic shifting


def test_samples_come_from_the_pipeline(pipe):
    validation = SimpleNamespace(height=32, width=48, steps=2, guidance=4.0)
    images = Flux2().sample(pipe, ["a red fox"], validation, torch.Generator().manual_seed(0))
    assert images.shape == (1, 3, 32, 48)
    assert images.min() >= 0 and images.max() <= 1


# -- the original-format LoRA -----------------------------------------------------------------
# Every Linear of the blocks, the shared modulations and the embedders; norm_out.linear apart
# (diffusers' Flux.2 LoRA converter keeps its rows in the file's order: module docstring).
TARGETS = (
    r"^(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|"
    r"to_out\.0|to_add_out)|ff\.linear_(in|out)|ff_context\.linear_(in|out))|"
    r"single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)|"
    r"(double|single)_stream_modulation(_img|_txt)?\.linear|x_embedder|context_embedder|"
    r"time_guidance_embed\.(timestep|guidance)_embedder\.linear_[12]|proj_out)$"
)


def adapted(targets):
    from litegen.config.sections import LoRAConfig
    from litegen.lora import apply_lora

    model = tiny_transformer()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=targets))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def inputs() -> dict:
    generator = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 8, 16, generator=generator),
        "encoder_hidden_states": torch.randn(1, 5, 96, generator=generator),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([1.0]),
        "img_ids": latent_ids(4, 8),
        "txt_ids": torch.zeros(5, 4),
    }


@torch.no_grad()
def outputs(model) -> torch.Tensor:
    return model.eval()(**inputs(), return_dict=False)[0]


def test_original_lora_fuses_qkv_and_loads_in_flux2_pipeline_as_trained(tmp_path: Path):
    from diffusers import Flux2Pipeline
    from safetensors.torch import load_file

    from litegen.finetune.export import write_original_lora

    trained = adapted(TARGETS)
    path = write_original_lora(
        trained, trained.state_dict(), tmp_path / "run.original.lora.safetensors"
    )
    original = load_file(path)
    assert original["diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight"].shape == (96, 12)
    assert original["diffusion_model.single_blocks.1.linear1.lora_A.weight"].shape == (4, 32)
    assert not any(key.endswith(".alpha") for key in original)  # the scale is in lora_B

    want = outputs(trained)
    fresh = tiny_transformer()
    assert (want - outputs(fresh)).abs().max() > 1e-2  # the adapters do something
    pipe = Flux2Pipeline.from_pretrained(tiny_pipeline_folder("flux2"), transformer=fresh)
    pipe.load_lora_weights(str(path))
    torch.testing.assert_close(outputs(pipe.transformer), want, rtol=1e-5, atol=1e-5)


def test_original_lora_round_trips_with_norm_out_in_bfl_order():
    from litegen.lora import adapter_alpha_state
    from litegen.model_keys.original_format import lora_from_original, lora_to_original, output_rows

    trained = adapted("all-linear")
    adapters = adapter_alpha_state(trained, trained.state_dict())
    rows = output_rows(trained)
    original = lora_to_original(adapters, ORIGINAL_KEYS, rows=rows)
    up = original["diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight"]
    ours = adapters["norm_out.linear.lora_B.weight"] * 2  # alpha / rank folded in
    torch.testing.assert_close(up, torch.cat([ours[32:], ours[:32]]))
    back = lora_from_original(original, ORIGINAL_KEYS, rows=rows)
    for key, value in adapters.items():
        if key.endswith("lora_A.weight"):
            torch.testing.assert_close(back[key], value)
        elif key.endswith("lora_B.weight"):
            module = key.removesuffix(".lora_B.weight")
            scale = float(back[f"{module}.alpha"]) / back[f"{module}.lora_A.weight"].shape[0]
            torch.testing.assert_close(back[key] * scale, value * 2)


def test_weights_load_with_from_single_file(tmp_path: Path):
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file

    from litegen.model_keys.original_format import weights_to_original

    model = tiny_transformer()
    original = weights_to_original(model.state_dict(), ORIGINAL_KEYS)
    assert "double_blocks.0.img_attn.qkv.weight" in original
    save_file({k: v.contiguous() for k, v in original.items()}, tmp_path / "flux2.safetensors")
    loaded = Flux2Transformer2DModel.from_single_file(
        str(tmp_path / "flux2.safetensors"),
        config=str(tiny_pipeline_folder("flux2") / "transformer"),
        local_files_only=True,
    )
    torch.testing.assert_close(outputs(loaded), outputs(model))


def test_the_key_map_follows_a_transformer_that_fully_shard_subclassed():
    """fully_shard turns a model's class into an FSDP<class> subclass: the export still finds
    the original layout (a run under fsdp2 writes the original-format LoRA)."""
    from diffusers import Flux2Transformer2DModel

    from litegen.families import key_map_for

    sharded = type("FSDPFlux2Transformer2DModel", (Flux2Transformer2DModel,), {})
    assert key_map_for(object.__new__(sharded)) is ORIGINAL_KEYS
    assert key_map_for("FSDPFlux2Transformer2DModel") is None  # a name alone is taken as said


# -- the optional reference image ---------------------------------------------------------------
def test_forward_with_a_reference_is_the_pipelines_call_cut_to_the_target(pipe):
    from litegen.families.flux2 import REFERENCE

    model = tiny_transformer()
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 4, 4, 4, generator=generator)
    reference = torch.randn(2, 4, 4, 8, generator=generator)
    text = torch.randn(2, 6, 96, generator=generator)
    sigmas = torch.tensor([0.25, 0.75])
    batch = {"prompt_embeds": text, REFERENCE: reference}
    with torch.no_grad():
        ours = Flux2().predict(model, latents, sigmas, batch)
        patchified = pipe._patchify_latents(latents)
        ids = pipe._prepare_latent_ids(patchified)
        reference_patches = pipe._patchify_latents(reference)
        reference_ids = pipe._prepare_image_ids([reference_patches[:1]]).expand(2, -1, -1)
        assert reference_ids[0, 0].tolist() == [10, 0, 0, 0]
        tokens = model(
            hidden_states=torch.cat(
                [pipe._pack_latents(patchified), pipe._pack_latents(reference_patches)], dim=1
            ),
            encoder_hidden_states=text,
            timestep=sigmas,
            guidance=torch.ones(2),
            img_ids=torch.cat([ids, reference_ids], dim=1),
            txt_ids=pipe._prepare_text_ids(text),
            return_dict=False,
        )[0]
        without = Flux2().predict(model, latents, sigmas, {"prompt_embeds": text})
    target = tokens[:, : ids.shape[1]]
    theirs = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(target, ids))
    torch.testing.assert_close(ours, theirs)
    assert (ours - without).abs().max() > 1e-4  # the reference is attended to


def test_samples_with_a_reference_are_the_pipelines(pipe):
    from PIL import Image

    validation = SimpleNamespace(height=32, width=32, steps=2, guidance=4.0)
    reference = Image.new("RGB", (64, 64), (200, 30, 30))  # the pipeline takes 64 px or more
    ours = Flux2().sample(
        pipe, ["make it blue"], validation, torch.Generator().manual_seed(0),
        conditions={"reference": [reference]},
    )  # fmt: skip
    theirs = pipe(
        image=[reference], prompt="make it blue", height=32, width=32, num_inference_steps=2,
        guidance_scale=4.0, max_sequence_length=64, text_encoder_out_layers=(1, 2, 3),
        generator=torch.Generator().manual_seed(0), output_type="pt",
    ).images  # fmt: skip
    plain = Flux2().sample(pipe, ["make it blue"], validation, torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours, theirs)
    assert not torch.allclose(ours, plain)
