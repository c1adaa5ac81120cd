"""HunyuanVideo 1.5 (text-to-video): the registry finds the family, its text conditions are the
pipeline's with exactly the system message dropped, its latents decode as the pipeline decodes
them, its training forward is the pipeline's transformer call (zero image-to-video channels
and vision tokens, untrimmed text), and its diffusers-format LoRA loads through the
transformer's own ``load_lora_adapter`` with the trained outputs. Its original-format LoRA and
full weights (Tencent's names, the token refiner's q/k/v fused) read back through LiteGen's
inverse converters give the trained outputs; diffusers reads neither form, so the map is
checked against diffusers' conversion script by hand (docs/families.md)."""

from __future__ import annotations

import functools

import pytest
import torch

from litegen.config.sections import LoRAConfig
from litegen.families import family_for_pipeline, family_for_transformer, key_map_for
from litegen.families.hunyuan_video15 import ORIGINAL_KEYS, HunyuanVideo15
from litegen.finetune.export import write_export
from litegen.lora import apply_lora
from litegen.model_keys.original_format import (
    lora_from_original,
    output_rows,
    weights_from_original,
    weights_to_original,
)

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")


@functools.cache
def tiny_pipe():
    return HunyuanVideo15.tiny_pipeline()


def tiny_transformer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return diffusers.HunyuanVideo15Transformer3DModel(**HunyuanVideo15.tiny_config).eval()


def test_the_registry_finds_hunyuan_video15_and_its_original_key_map():
    assert family_for_pipeline("HunyuanVideo15Pipeline") is HunyuanVideo15
    assert family_for_transformer("HunyuanVideo15Transformer3DModel") is HunyuanVideo15
    assert key_map_for("HunyuanVideo15Transformer3DModel") is ORIGINAL_KEYS
    assert HunyuanVideo15.sequence_plan(tiny_transformer()) is None


def test_the_text_conditions_are_the_pipelines_without_the_system_message():
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    pipe = tiny_pipe()
    captions = ['a fox holding a sign that says "hello"', "a cat walking on a wooden table"]
    encoded = HunyuanVideo15().encode_text(pipe, captions)
    assert encoded["prompt_embeds"].shape == (2, 1000, 32)
    assert encoded["prompt_embeds_2"].shape == (2, 256, 32)
    # The dropped head is the system message's turn and the user turn's opening: 108 tokens.
    messages = format_text_input(["X"], pipe.system_message)
    text = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head = text[0].split("X")[0]
    assert len(pipe.tokenizer(head).input_ids) == pipe.prompt_template_encode_start_idx
    for row, caption in enumerate(captions):
        tokens = len(pipe.tokenizer(caption).input_ids) + 5  # the template's tail
        assert encoded["prompt_embeds_mask"][row].sum() == tokens
    # Glyph text: the quoted words only, as 'Text "hello". ' in ByT5 bytes and </s>.
    glyphs = encoded["prompt_embeds_mask_2"].sum(dim=1).tolist()
    assert glyphs == [len(b'Text "hello". ') + 1, 0]
    assert not encoded["prompt_embeds_2"][1].any()
    embeds, _, embeds_2, _ = pipe.encode_prompt(captions, device="cpu", batch_size=2)
    torch.testing.assert_close(encoded["prompt_embeds"], embeds)
    torch.testing.assert_close(encoded["prompt_embeds_2"], embeds_2)


def test_latents_decode_as_the_pipeline_decodes_them():
    pipe = tiny_pipe()
    clips = torch.rand(2, 3, 5, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = HunyuanVideo15().encode_latents(pipe, clips, micro_batch_size=2)
    assert latents.shape == (2, 4, 2, 2, 2)
    raw = pipe.vae.encode(clips[:1]).latent_dist.mode()
    # The pipeline's decode: latents / scaling_factor, then the VAE.
    torch.testing.assert_close(latents[:1] / pipe.vae.config.scaling_factor, raw)
    image = HunyuanVideo15().encode_latents(pipe, clips[:, :, 0], micro_batch_size=1)
    assert image.shape == (2, 4, 1, 2, 2)


def batch(text: int = 12, glyphs: int = 8) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    mask, mask_2 = torch.zeros(2, text, dtype=torch.long), torch.zeros(2, glyphs, dtype=torch.long)
    mask[0, :7], mask[1, :4], mask_2[0, :3] = 1, 1, 1
    return {
        "latents": torch.randn(2, 4, 2, 2, 3, generator=generator),
        "prompt_embeds": torch.randn(2, text, 32, generator=generator) * mask[..., None],
        "prompt_embeds_mask": mask,
        "prompt_embeds_2": torch.randn(2, glyphs, 32, generator=generator) * mask_2[..., None],
        "prompt_embeds_mask_2": mask_2,
    }


def pipeline_call(model, latents, sigmas, cached) -> torch.Tensor:
    """The pipeline's text-to-video call: zero conditioning latents and mask on channels, 729
    zero vision tokens, timesteps in [0, 1000], the text as cached (untrimmed)."""
    b, c = latents.shape[:2]
    hidden = torch.cat([latents, torch.zeros(b, c, *latents.shape[2:]),
                        torch.zeros(b, 1, *latents.shape[2:])], dim=1)  # fmt: skip
    return model(
        hidden_states=hidden,
        image_embeds=torch.zeros(b, 729, model.config.image_embed_dim),
        timestep=sigmas * 1000,
        encoder_hidden_states=cached["prompt_embeds"],
        encoder_attention_mask=cached["prompt_embeds_mask"].float(),
        encoder_hidden_states_2=cached["prompt_embeds_2"],
        encoder_attention_mask_2=cached["prompt_embeds_mask_2"].float(),
        return_dict=False,
    )[0]


@pytest.mark.parametrize("glyphs", [True, False], ids=["glyphs", "no-glyphs"])
def test_the_forward_is_the_pipelines_transformer_call(glyphs):
    model, cached = tiny_transformer(), batch()
    if not glyphs:
        cached["prompt_embeds_mask_2"].zero_()
        cached["prompt_embeds_2"].zero_()
    latents, sigmas = cached["latents"], torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = HunyuanVideo15().predict(model, latents, sigmas, cached)
        theirs = pipeline_call(model, latents, sigmas, cached)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_validation_sample_is_a_video():
    from types import SimpleNamespace

    validation = SimpleNamespace(height=32, width=32, steps=2, guidance=3.0, frames=5)
    # As the fine-tuning road samples: the pipeline built without its transformer, given it.
    parts = {name: value for name, value in tiny_pipe().components.items()}
    pipe = type(tiny_pipe())(**{**parts, "transformer": None})
    pipe.transformer = tiny_pipe().transformer
    video = HunyuanVideo15().sample(pipe, ["a red fox"], validation,
                                    torch.Generator().manual_seed(0))  # fmt: skip
    assert video.shape == (1, 3, 5, 32, 32) and 0 <= video.min() <= video.max() <= 1
    assert pipe.guider.guidance_scale == 6.0  # the pipeline's own guider is put back


def test_the_diffusers_lora_loads_in_the_transformer_as_trained(tmp_path):
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.0.proj",
               "proj_out", "x_embedder.proj"]  # fmt: skip
    trained = tiny_transformer()
    apply_lora(trained, LoRAConfig(rank=4, alpha=8, target_modules=targets))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    out = write_export(trained, trained.state_dict(), "unused", tmp_path, name="run")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["run.lora.safetensors", "run.original.lora.safetensors", "run.peft"]
    cached, sigmas, family = batch(), torch.tensor([0.5, 0.5]), HunyuanVideo15()
    fresh = tiny_transformer()
    with torch.no_grad():
        want = family.predict(trained, cached["latents"], sigmas, cached)
        base = family.predict(fresh, cached["latents"], sigmas, cached)
        assert (want - base).abs().max() > 1e-2  # the adapters do something
        fresh.load_lora_adapter(str(out / "run.lora.safetensors"), prefix="transformer")
        got = family.predict(fresh, cached["latents"], sigmas, cached)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def merge(model: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model`` with each adapter's ``alpha / rank * lora_B @ lora_A`` added to its weight."""
    state = model.state_dict()
    with torch.no_grad():
        for key, down in adapters.items():
            module, sep, _ = key.partition(".lora_A.weight")
            if sep:
                up, alpha = adapters[f"{module}.lora_B.weight"], adapters[f"{module}.alpha"]
                weight = state[f"{module}.weight"]
                delta = float(alpha) / down.shape[0] * (up.flatten(1) @ down.flatten(1))
                weight += delta.view_as(weight)
    return model


def test_the_original_lora_reads_back_with_the_trained_outputs(tmp_path):
    from safetensors.torch import load_file

    trained = tiny_transformer()
    apply_lora(trained, LoRAConfig(rank=4, alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    out = write_export(trained, trained.state_dict(), "unused", tmp_path, name="run")
    original = load_file(out / "run.original.lora.safetensors")
    refiner = "diffusion_model.txt_in.individual_token_refiner.blocks.0."
    assert original[f"{refiner}self_attn_qkv.lora_A.weight"].shape == (12, 32)  # q, k, v fused
    assert original[f"{refiner}self_attn_qkv.lora_B.weight"].shape == (96, 12)
    assert float(original[f"{refiner}self_attn_qkv.alpha"]) == 24  # alpha / rank kept at 2
    assert "diffusion_model.double_blocks.1.img_attn_q.lora_B.weight" in original
    assert "diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight" in original
    back = lora_from_original(original, ORIGINAL_KEYS, rows=output_rows(tiny_transformer()))
    cached, sigmas, family = batch(), torch.tensor([0.3, 0.8]), HunyuanVideo15()
    with torch.no_grad():
        want = family.predict(trained, cached["latents"], sigmas, cached)
        base = family.predict(tiny_transformer(), cached["latents"], sigmas, cached)
        got = family.predict(merge(tiny_transformer(), back), cached["latents"], sigmas, cached)
    assert (want - base).abs().max() > 1e-2  # the adapters do something
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_original_weights_read_back_with_the_same_outputs(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_transformer(seed=3)
    with torch.no_grad():  # modulation and norms away from their initial values
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    original = weights_to_original(model.state_dict(), ORIGINAL_KEYS)
    assert original["txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"].shape == (
        96, 32)  # fmt: skip
    # Tencent's final modulation is (shift, scale), diffusers' norm_out.linear (scale, shift).
    scale_shift = model.norm_out.linear.weight
    assert torch.equal(
        original["final_layer.adaLN_modulation.1.weight"], scale_shift.roll(32, dims=0)
    )
    save_file({k: v.contiguous() for k, v in original.items()}, tmp_path / "hy.safetensors")
    back = weights_from_original(
        load_file(tmp_path / "hy.safetensors"), ORIGINAL_KEYS, rows=output_rows(model)
    )
    fresh = tiny_transformer(seed=4)
    fresh.load_state_dict(back, strict=True)
    cached, sigmas, family = batch(), torch.tensor([0.3, 0.8]), HunyuanVideo15()
    with torch.no_grad():
        want = family.predict(model, cached["latents"], sigmas, cached)
        got = family.predict(fresh, cached["latents"], sigmas, cached)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
