"""HunyuanVideo 1.5 (text-to-video): the registry finds the family, its text conditions are the
pipeline's with exactly the system message dropped, its latents decode as the pipeline decodes
them, its training forward is the pipeline's transformer call (zero image-to-video channels
and vision tokens, untrimmed text), and its diffusers-format LoRA loads through the
transformer's own ``load_lora_adapter`` with the trained outputs. There is no original-format
map: diffusers has no converter to check one against."""

from __future__ import annotations

import functools

import pytest
import torch

from litegen.config.sections import LoRAConfig
from litegen.families import family_for_pipeline, family_for_transformer, key_map_for
from litegen.families.hunyuan_video15 import HunyuanVideo15
from litegen.finetune.export import write_export
from litegen.lora import apply_lora

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")


@functools.cache
def tiny_pipe():
    return HunyuanVideo15.tiny_pipeline()


def tiny_transformer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return diffusers.HunyuanVideo15Transformer3DModel(**HunyuanVideo15.tiny_config).eval()


def test_the_registry_finds_hunyuan_video15_and_it_has_no_original_key_map():
    assert family_for_pipeline("HunyuanVideo15Pipeline") is HunyuanVideo15
    assert family_for_transformer("HunyuanVideo15Transformer3DModel") is HunyuanVideo15
    assert key_map_for("HunyuanVideo15Transformer3DModel") is None
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
    assert sorted(p.name for p in out.iterdir()) == ["run.lora.safetensors", "run.peft"]
    cached, sigmas, family = batch(), torch.tensor([0.5, 0.5]), HunyuanVideo15()
    fresh = tiny_transformer()
    with torch.no_grad():
        want = family.predict(trained, cached["latents"], sigmas, cached)
        base = family.predict(fresh, cached["latents"], sigmas, cached)
        assert (want - base).abs().max() > 1e-2  # the adapters do something
        fresh.load_lora_adapter(str(out / "run.lora.safetensors"), prefix="transformer")
        got = family.predict(fresh, cached["latents"], sigmas, cached)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
