"""LTX-Video's family checked against diffusers' own LTX code: the latents normalised as the
pipeline's ``_normalize_latents``, the training forward equal to the pipeline's transformer
call (``_pack_latents``, ``rope_interpolation_scale``, the T5 mask), the shift equal to its
``calculate_shift``, first-frame conditioning equal to the image-to-video pipeline's per-token
timesteps, samples drawn through ``LTXPipeline`` and ``LTXImageToVideoPipeline``, the plan of
``plans.py`` the family's, and the original key map read back by diffusers' own converters
(``convert_ltx_transformer_checkpoint_to_diffusers`` for full weights, ``load_lora_weights`` for
LoRA files).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from litegen.families import family_for_pipeline, family_for_transformer, key_map_for
from litegen.families.ltx_video import LTXVideo, LTXVideoI2V
from litegen.model_keys.original_format import (
    lora_from_original,
    lora_to_original,
    output_rows,
    weights_from_original,
    weights_to_original,
)
from litegen.objectives import FlowMatching

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

# Every Linear LoRA usually adapts, and the three the original names differently.
BLOCK_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
RENAMED_TARGETS = ["proj_in", "time_embed.linear", "timestep_embedder.linear_1"]


@pytest.fixture(scope="module")
def pipe():
    return LTXVideo.tiny_pipeline()


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return diffusers.LTXVideoTransformer3DModel(**LTXVideo.tiny_config)


def batch(frames: int = 2, size: int = 3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    mask = torch.zeros(2, 6)
    mask[0, :2], mask[1, :5] = 1, 1
    return {
        "latents": torch.randn(2, 4, frames, size, size, generator=generator),
        "prompt_embeds": torch.randn(2, 6, 32, generator=generator),
        "prompt_attention_mask": mask,
    }


def test_the_registry_finds_ltx_by_its_classes_and_the_tiny_pipeline_has_them(pipe):
    assert family_for_pipeline("LTXPipeline") is LTXVideo
    assert family_for_pipeline("LTXImageToVideoPipeline") is LTXVideoI2V
    assert family_for_transformer("LTXVideoTransformer3DModel") is LTXVideo
    assert type(LTXVideoI2V.tiny_pipeline()).__name__ == "LTXImageToVideoPipeline"
    assert key_map_for("LTXVideoTransformer3DModel") is LTXVideo.original_keys
    assert type(pipe).__name__ == "LTXPipeline"
    assert dict(pipe.transformer.config) | LTXVideo.tiny_config == dict(pipe.transformer.config)
    # The tiny VAE keeps the published latent rules: 32x in space, 8x in time.
    assert pipe.vae_spatial_compression_ratio == LTXVideo.latent.spatial_multiple == 32
    assert pipe.vae_temporal_compression_ratio == 8
    assert LTXVideo().temporal_compression(dict(pipe.vae.config)) == 8
    assert LTXVideo().temporal_compression({}) == 8  # the published VAE's defaults


def test_latents_are_normalised_as_the_pipeline_does(pipe):
    pixels = torch.rand(2, 3, 9, 64, 32) * 2 - 1
    ours = LTXVideo().encode_latents(pipe, pixels, micro_batch_size=1)
    with torch.no_grad():
        raw = pipe.vae.encode(pixels).latent_dist.mode()
    theirs = pipe._normalize_latents(
        raw, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
    )
    assert ours.shape == (2, 4, 2, 2, 1)
    torch.testing.assert_close(ours, theirs)
    back = pipe._denormalize_latents(
        ours, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
    )
    torch.testing.assert_close(back, raw)  # the decode's inverse: mean and std not 0 and 1
    images = LTXVideo().encode_latents(pipe, pixels[:, :, 0], micro_batch_size=2)
    torch.testing.assert_close(images, ours[:, :, :1])  # an image: the clip's first frame


def test_the_text_conditions_are_the_t5_embeddings_and_their_mask(pipe):
    with torch.no_grad():
        ours = LTXVideo().encode_text(pipe, ["a cat", "a red fox in the snow"])
        embeds, mask, _, _ = pipe.encode_prompt(
            ["a cat", "a red fox in the snow"], do_classifier_free_guidance=False,
            max_sequence_length=32,
        )  # fmt: skip
    torch.testing.assert_close(ours["prompt_embeds"], embeds)
    torch.testing.assert_close(ours["prompt_attention_mask"], mask.float())
    assert 0 < mask[0].sum() < mask[1].sum() < 32


def test_the_forward_is_the_pipelines_transformer_call():
    from diffusers import LTXPipeline

    model, data = tiny_model(), batch()
    sigmas = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = LTXVideo().predict(model, data["latents"], sigmas, data)
        tokens = model(
            hidden_states=LTXPipeline._pack_latents(data["latents"]),
            encoder_hidden_states=data["prompt_embeds"],
            timestep=torch.tensor([250.0, 750.0]),
            encoder_attention_mask=data["prompt_attention_mask"].bool(),
            num_frames=2,
            height=3,
            width=3,
            rope_interpolation_scale=(8 / 25, 32, 32),  # the pipeline's at frame_rate 25
            return_dict=False,
        )[0]
    torch.testing.assert_close(ours, LTXPipeline._unpack_latents(tokens, 2, 3, 3))
    # The mask matters: the padding is left out of cross-attention.
    with torch.no_grad():
        unmasked = LTXVideo().predict(model, data["latents"], sigmas, data | {
            "prompt_attention_mask": torch.ones(2, 6)})  # fmt: skip
    assert not torch.allclose(ours, unmasked)


def test_the_shift_is_the_pipelines_by_token_count(pipe):
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    config = dict(pipe.scheduler.config)
    family = LTXVideo(config)
    for latents in (torch.zeros(1, 4, 2, 2, 2), torch.zeros(1, 4, 3, 4, 5)):
        tokens = latents[0, 0].numel()
        mu = calculate_shift(tokens, config["base_image_seq_len"], config["max_image_seq_len"],
                             config["base_shift"], config["max_shift"])  # fmt: skip
        assert family.seq_len(latents) == tokens
        assert family.shift_for(tokens) == pytest.approx(math.exp(mu))


def test_first_frame_conditioning_is_the_image_to_video_pipelines_per_token_timestep():
    """The first latent frame is the given first frame's latents, clean at timestep 0 (the
    pipeline's ``t * (1 - conditioning_mask)``); the loss covers the other frames only."""
    model, data = tiny_model(), batch(frames=3)
    first = torch.randn(2, 4, 1, 3, 3, generator=torch.Generator().manual_seed(5))
    data["first_frame_latents"] = first
    objective = FlowMatching(density="uniform")
    torch.manual_seed(1)
    ours = LTXVideoI2V().loss(model, data, objective)

    torch.manual_seed(1)
    x0 = data["latents"]
    noise = torch.randn_like(x0)
    sigmas = objective.sample_sigmas(2, device=x0.device, shift=None).view(-1, 1, 1, 1, 1)
    condition = torch.zeros(2, 1, 3, 3, 3)
    condition[:, :, 0] = 1.0
    init = first.repeat(1, 1, 3, 1, 1)  # as the pipeline's prepare_latents
    noisy = init * condition + ((1 - sigmas) * x0 + sigmas * noise) * (1 - condition)
    pipeline = diffusers.LTXImageToVideoPipeline
    mask = pipeline._pack_latents(condition).squeeze(-1)
    timestep = (sigmas.view(-1) * 1000).unsqueeze(-1) * (1 - mask)
    tokens = model(
        hidden_states=pipeline._pack_latents(noisy),
        encoder_hidden_states=data["prompt_embeds"],
        timestep=timestep,
        encoder_attention_mask=data["prompt_attention_mask"],
        num_frames=3, height=3, width=3, rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )[0]  # fmt: skip
    velocity = pipeline._unpack_latents(tokens, 3, 3, 3)
    theirs = ((velocity - (noise - x0))[:, :, 1:] ** 2).mean()
    torch.testing.assert_close(ours, theirs)
    ours.backward()
    assert all(p.grad is not None for p in model.parameters())

    one_frame = batch(frames=1) | {"first_frame_latents": first}
    with pytest.raises(ValueError, match=r"at least 9 frames.*finetune\.data\.max_frames"):
        LTXVideoI2V().loss(model, one_frame, objective)


def test_the_first_frame_condition_is_the_clips_first_latent_frame(pipe):
    clip = torch.rand(2, 3, 9, 64, 32) * 2 - 1
    i2v = LTXVideoI2V()
    latents = i2v.encode_latents(pipe, clip, micro_batch_size=2)
    condition = i2v.encode_condition(pipe, "image", clip[:, :, 0], clip, micro_batch_size=2)
    assert condition.keys() == {"first_frame_latents"}
    torch.testing.assert_close(condition["first_frame_latents"], latents[:, :, :1])


def test_samples_come_from_the_text_and_image_to_video_pipelines(pipe):
    from PIL import Image

    validation = SimpleNamespace(height=64, width=32, steps=2, guidance=3.0, frames=9)
    text = LTXVideo().sample(pipe, ["a cat"], validation, torch.Generator().manual_seed(0))
    i2v = LTXVideoI2V.tiny_pipeline()
    first = Image.new("RGB", (32, 64), (200, 40, 40))
    image = LTXVideoI2V().sample(
        i2v, ["a cat"], validation, torch.Generator().manual_seed(0), {"image": [first]}
    )
    assert text.shape == image.shape == (1, 3, 9, 64, 32)
    assert text.min() >= 0 and text.max() <= 1
    assert not torch.allclose(text, image)
    with pytest.raises(ValueError, match=r"trainer\.validation\.conditions\.image, one file per"):
        LTXVideoI2V().sample(i2v, ["a cat"], validation, torch.Generator())


def test_the_sequence_plan_of_plans_py_is_the_familys():
    from litegen.parallel.sequence.builtin_plans import BUILTIN, plan_for
    from litegen.parallel.sequence.sequence_plan import Split

    model = tiny_model()
    assert "LTXVideoTransformer3DModel" not in BUILTIN
    plan = plan_for(model)  # checked against the model
    assert plan == LTXVideo.sequence_plan(model)
    assert plan.split_inputs == {"": {"hidden_states": 1, "timestep": Split(1, ndim=2)}}
    assert plan.gather_outputs == {"proj_out": 1}


# -- the original checkpoint's names -----------------------------------------------------------
def test_full_weights_in_the_original_layout_are_what_diffusers_converts_back():
    from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers

    model = tiny_model()
    state = model.state_dict()
    original = weights_to_original(state, LTXVideo.original_keys)
    assert {"patchify_proj.weight", "adaln_single.linear.weight",
            "transformer_blocks.0.attn1.q_norm.weight"} <= original.keys()  # fmt: skip
    prefixed = {f"model.diffusion_model.{k}": v for k, v in original.items()}
    theirs = convert_ltx_transformer_checkpoint_to_diffusers(prefixed)
    assert theirs.keys() == state.keys()
    assert all(torch.equal(theirs[k], state[k]) for k in state)
    ours = weights_from_original(original, LTXVideo.original_keys, rows=output_rows(model))
    assert all(torch.equal(ours[k], state[k]) for k in state)


def adapted(targets: list[str]):
    from peft import LoraConfig, inject_adapter_in_model

    model = tiny_model()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    model = inject_adapter_in_model(config, model)
    torch.manual_seed(2)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.1)
    return model


def adapters_of(model) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    modules = {k.rsplit(".lora_", 1)[0] for k in state}
    return state | {f"{m}.alpha": torch.tensor(8.0) for m in modules}


def test_original_lora_of_the_blocks_loads_in_diffusers_as_trained(tmp_path: Path, pipe):
    from safetensors.torch import save_file

    trained = adapted(BLOCK_TARGETS)
    original = lora_to_original(adapters_of(trained), LTXVideo.original_keys)
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in original)
    save_file(original, tmp_path / "run.original.lora.safetensors")

    fresh = diffusers.LTXPipeline(**{**pipe.components, "transformer": tiny_model()})
    fresh.load_lora_weights(str(tmp_path / "run.original.lora.safetensors"))
    data = batch()
    sigmas = torch.tensor([0.3, 0.6])
    with torch.no_grad():
        theirs = LTXVideo().predict(fresh.transformer, data["latents"], sigmas, data)
        ours = LTXVideo().predict(trained, data["latents"], sigmas, data)
        base = LTXVideo().predict(tiny_model(), data["latents"], sigmas, data)
    torch.testing.assert_close(theirs, ours)
    assert not torch.allclose(ours, base)
    assert load_file(tmp_path / "run.original.lora.safetensors").keys() == original.keys()


def test_lora_of_the_renamed_modules_round_trips_through_the_original_names():
    """diffusers 0.42.1 strips the prefix of an original LTX LoRA and renames nothing, so
    these adapters are ComfyUI's to read; LiteGen's own inverse reads them back."""
    trained = adapted([*BLOCK_TARGETS, *RENAMED_TARGETS])
    adapters = adapters_of(trained)
    original = lora_to_original(adapters, LTXVideo.original_keys)
    assert {"diffusion_model.patchify_proj.lora_A.weight",
            "diffusion_model.adaln_single.linear.lora_B.weight",
            "diffusion_model.adaln_single.emb.timestep_embedder.linear_1.lora_B.weight"} <= original.keys()  # fmt: skip
    back = lora_from_original(original, LTXVideo.original_keys)
    assert back.keys() == adapters.keys()
    ours, theirs = deltas(adapters), deltas(back)  # the scale moved into lora_B and back
    assert (
        ours.keys() == theirs.keys() and len(ours) == 2 * 10 + 3
    )  # 2 blocks x (8 attention, 2 ff)
    for module, delta in ours.items():
        torch.testing.assert_close(theirs[module], delta)


def deltas(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each module's weight update, ``alpha / rank * B @ A``."""
    out = {}
    for key, down in adapters.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            scale = float(adapters[f"{module}.alpha"]) / down.shape[0]
            out[module] = scale * adapters[f"{module}.lora_B.weight"] @ down
    return out


def test_the_key_map_is_found_through_fully_shards_subclass():
    """fully_shard turns a model's class into an ``FSDP<Name>`` subclass of it."""
    sharded = type("FSDPLTXVideoTransformer3DModel", (diffusers.LTXVideoTransformer3DModel,), {})
    torch.manual_seed(0)
    assert key_map_for(sharded(**LTXVideo.tiny_config)) is LTXVideo.original_keys
