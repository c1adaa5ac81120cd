"""Qwen-Image (text-to-image): the registry finds the family, its text conditions are the
pipeline's with exactly the chat template dropped, its latents decode as the pipeline decodes
them, its training forward is the pipeline's transformer call, trimming the text padding
changes nothing, and its LoRA exports (diffusers and original layout) load in diffusers'
``QwenImagePipeline.load_lora_weights`` with the trained outputs."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file

from litegen.config.sections import LoRAConfig
from litegen.families import family_for_pipeline, family_for_transformer, key_map_for
from litegen.families.qwen_image import ORIGINAL_KEYS, QwenImage
from litegen.finetune.export import write_export
from litegen.lora import adapter_alpha_state, apply_lora
from litegen.model_keys.original_format import lora_from_original, output_rows
from litegen.objectives import FlowMatching, resolution_shift

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")


@functools.cache
def tiny_pipe():
    return QwenImage.tiny_pipeline()


def tiny_transformer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return diffusers.QwenImageTransformer2DModel(**QwenImage.tiny_config).eval()


def test_the_registry_finds_qwen_image_by_its_classes():
    assert family_for_pipeline("QwenImagePipeline") is QwenImage
    assert family_for_transformer("QwenImageTransformer2DModel") is QwenImage
    assert key_map_for("QwenImageTransformer2DModel") is ORIGINAL_KEYS
    pipe = tiny_pipe()
    assert type(pipe.transformer).__name__ == QwenImage.transformer_class
    assert pipe.transformer.config.num_layers == QwenImage.tiny_config["num_layers"]


def test_the_text_conditions_are_the_pipelines_without_the_template_and_padded():
    pipe = tiny_pipe()
    captions = ["a red fox", "a cat walking on a wooden table in the snow"]
    encoded = QwenImage().encode_text(pipe, captions)
    embeds, mask = encoded["prompt_embeds"], encoded["prompt_embeds_mask"]
    assert embeds.shape == (2, 32, 32) and mask.shape == (2, 32)  # the tokenizer's length
    for row, caption in enumerate(captions):
        # The caption's tokens and the template's tail (<|im_end|> \n <|im_start|> assistant \n):
        # the first 34 tokens, the template's head, are exactly those the pipeline drops.
        tokens = len(pipe.tokenizer(caption).input_ids) + 5
        assert mask[row].tolist() == [1] * tokens + [0] * (32 - tokens)
        alone, _ = pipe.encode_prompt([caption], device="cpu")
        torch.testing.assert_close(embeds[row, :tokens], alone[0])
        assert not embeds[row, tokens:].any()
    head = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(head).input_ids) == pipe.prompt_template_encode_start_idx


def test_latents_decode_as_the_pipeline_decodes_them():
    pipe = tiny_pipe()
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = QwenImage().encode_latents(pipe, pixels, micro_batch_size=2)
    assert latents.shape == (2, 4, 4, 4)
    raw = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
    # The pipeline's decode: latents / (1 / std) + mean, then the VAE.
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, 4, 1, 1, 1)
    torch.testing.assert_close(latents.unsqueeze(2) * std + mean, raw, rtol=1e-5, atol=1e-5)


def batch(length: int = 8) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    mask = torch.zeros(2, length, dtype=torch.long)
    mask[0, :5], mask[1, :3] = 1, 1
    return {
        "latents": torch.randn(2, 4, 4, 6, generator=generator),
        "prompt_embeds": torch.randn(2, length, 32, generator=generator) * mask[..., None],
        "prompt_embeds_mask": mask,
    }


def test_the_forward_is_the_pipelines_transformer_call():
    from diffusers import QwenImagePipeline

    model, cached = tiny_transformer(), batch()
    latents, sigmas = cached["latents"], torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = QwenImage().predict(model, latents, sigmas, cached)
        tokens = model(
            hidden_states=QwenImagePipeline._pack_latents(latents, 2, 4, 4, 6),
            timestep=sigmas,  # the pipeline's timestep / 1000
            encoder_hidden_states=cached["prompt_embeds"],
            encoder_hidden_states_mask=cached["prompt_embeds_mask"],
            img_shapes=[[(1, 2, 3)]] * 2,
            return_dict=False,
        )[0]
    # The pipeline's unpack takes pixel sizes (8x the latents') and gives (B, C, 1, H, W).
    theirs = QwenImagePipeline._unpack_latents(tokens, 32, 48, 8)[:, :, 0]
    torch.testing.assert_close(ours, theirs)


def test_reference_latents_follow_the_noisy_tokens_as_in_the_edit_pipeline():
    """QwenImageEditPipeline's call: [noisy, reference] tokens, one img_shapes entry each, the
    prediction cut to the noisy tokens."""
    from diffusers import QwenImageEditPipeline

    model, cached = tiny_transformer(), batch()
    reference = torch.randn(2, 4, 6, 4, generator=torch.Generator().manual_seed(5))
    latents, sigmas = cached["latents"], torch.tensor([0.25, 0.75])
    pack = QwenImageEditPipeline._pack_latents
    with torch.no_grad():
        ours = QwenImage().predict(
            model, latents, sigmas, {**cached, "reference_latents": reference}
        )
        tokens = model(
            hidden_states=torch.cat([pack(latents, 2, 4, 4, 6), pack(reference, 2, 4, 6, 4)], 1),
            timestep=sigmas,
            encoder_hidden_states=cached["prompt_embeds"],
            encoder_hidden_states_mask=cached["prompt_embeds_mask"],
            img_shapes=[[(1, 2, 3), (1, 3, 2)]] * 2,
            return_dict=False,
        )[0][:, :6]
        alone = QwenImage().predict(model, latents, sigmas, cached)
    theirs = QwenImageEditPipeline._unpack_latents(tokens, 32, 48, 8)[:, :, 0]
    torch.testing.assert_close(ours, theirs)
    assert (ours - alone).abs().max() > 1e-3  # the reference tokens are attended to


def test_trimming_the_text_padding_changes_nothing():
    model, short = tiny_transformer(), batch(length=8)
    long = dict(short)
    long["prompt_embeds"] = torch.cat([short["prompt_embeds"], torch.randn(2, 24, 32)], dim=1)
    long["prompt_embeds_mask"] = torch.cat([short["prompt_embeds_mask"], torch.zeros(2, 24)], 1)
    sigmas = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        a = QwenImage().predict(model, short["latents"], sigmas, short)
        b = QwenImage().predict(model, short["latents"], sigmas, long)
        untrimmed = model(
            hidden_states=diffusers.QwenImagePipeline._pack_latents(short["latents"], 2, 4, 4, 6),
            timestep=sigmas,
            encoder_hidden_states=long["prompt_embeds"],
            encoder_hidden_states_mask=long["prompt_embeds_mask"],
            img_shapes=[[(1, 2, 3)]] * 2,
            return_dict=False,
        )[0]
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(
        a, diffusers.QwenImagePipeline._unpack_latents(untrimmed, 32, 48, 8)[:, :, 0]
    )


def test_the_loss_shifts_by_token_count_as_the_pipeline():
    pipe = tiny_pipe()
    family = QwenImage(pipe.scheduler.config)
    config = pipe.scheduler.config
    # 4x6 latents are 2x3 packed tokens: the pipeline's mu at 6 tokens, exp(mu) the shift.
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    mu = calculate_shift(6, config.base_image_seq_len, config.max_image_seq_len,
                         config.base_shift, config.max_shift)  # fmt: skip
    assert family.seq_len(batch()["latents"]) == 6
    assert family.shift_for(6) == pytest.approx(resolution_shift(6, base_seq_len=16,
                                                max_seq_len=256, max_shift=0.9))  # fmt: skip
    assert family.shift_for(6) == pytest.approx(torch.tensor(mu).exp().item())
    model = tiny_transformer()
    torch.manual_seed(0)
    loss = family.loss(model.train(), batch(), FlowMatching(density="logit_normal"))
    loss.backward()
    assert torch.isfinite(loss) and model.proj_out.weight.grad.abs().sum() > 0


def test_validation_samples_take_true_guidance():
    from types import SimpleNamespace

    validation = SimpleNamespace(height=32, width=32, steps=2, guidance=3.0, frames=None)
    image = QwenImage().sample(tiny_pipe(), ["a red fox"], validation,
                               torch.Generator().manual_seed(0))  # fmt: skip
    assert image.shape == (1, 3, 32, 32) and 0 <= image.min() <= image.max() <= 1


# -- LoRA exports through diffusers' loader -------------------------------------------------
TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "to_out.0", "to_add_out", "img_mlp.net.0.proj",
           "txt_mlp.net.2", "img_mod.1", "img_in", "txt_in", "proj_out", "norm_out.linear",
           "timestep_embedder.linear_1"]  # fmt: skip


def inputs() -> dict:
    generator = torch.Generator().manual_seed(3)
    return {
        "hidden_states": torch.randn(1, 6, 16, generator=generator),
        "encoder_hidden_states": torch.randn(1, 5, 32, generator=generator),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 2, 3)]],
    }


@torch.no_grad()
def outputs(model) -> torch.Tensor:
    return model(**inputs(), return_dict=False)[0]


def trained_lora() -> torch.nn.Module:
    model = tiny_transformer()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


@pytest.mark.parametrize("file", ["run.lora.safetensors", "run.original.lora.safetensors"])
def test_lora_exports_load_in_diffusers_as_trained(file, tmp_path):
    from diffusers import QwenImagePipeline

    trained = trained_lora()
    out = write_export(trained, trained.state_dict(), "unused", tmp_path, name="run")
    written = load_file(out / file)
    if "original" in file:
        assert "diffusion_model.transformer_blocks.1.attn.to_q.lora_A.weight" in written
        assert written["diffusion_model.img_in.alpha"] == 8
    fresh = tiny_transformer()
    want, base = outputs(trained), outputs(fresh)
    assert (want - base).abs().max() > 1e-2  # the adapters do something
    pipe = QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=fresh
    )
    pipe.load_lora_weights(str(out / file))
    torch.testing.assert_close(outputs(pipe.transformer), want, rtol=1e-5, atol=1e-5)


def test_the_original_lora_round_trips():
    trained = trained_lora()
    adapters = adapter_alpha_state(trained, trained.state_dict())
    from litegen.model_keys.original_format import lora_to_original

    rows = output_rows(trained)
    back = lora_from_original(lora_to_original(adapters, ORIGINAL_KEYS, rows=rows),
                              ORIGINAL_KEYS, rows=rows)  # fmt: skip
    assert back.keys() == adapters.keys()
    for key, value in adapters.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)
