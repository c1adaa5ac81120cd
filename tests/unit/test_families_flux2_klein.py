"""The Flux.2 [klein] family checked against Flux2KleinPipeline's own code: its text embedding is
``encode_prompt``'s (Qwen3, chat template), its forward is the pipeline's transformer call (no
guidance), and its samples are the pipeline's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from litegen.families import family_for_pipeline, family_for_transformer
from litegen.families.flux2 import Flux2
from litegen.families.flux2_klein import Flux2Klein
from tests.pipelines import tiny_pipeline_folder

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def pipe():
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(tiny_pipeline_folder("flux2_klein"))


def test_klein_is_a_variant_of_flux2_found_by_its_pipeline():
    assert family_for_pipeline("Flux2KleinPipeline") is Flux2Klein
    assert family_for_transformer("Flux2Transformer2DModel") is Flux2
    assert Flux2Klein.original_keys is Flux2.original_keys


def test_text_is_encode_prompts_at_the_tiny_encoders_layers(pipe):
    captions = ["a red fox", "a cat walking on a wooden table"]
    ours = Flux2Klein().encode_text(pipe, captions)["prompt_embeds"]
    theirs, _ = pipe.encode_prompt(
        captions, max_sequence_length=64, text_encoder_out_layers=(1, 2, 3)
    )
    torch.testing.assert_close(ours, theirs)
    assert ours.shape == (2, 64, 96)


def test_forward_is_the_pipelines_transformer_call_without_guidance(pipe):
    model = pipe.transformer
    assert not model.config.guidance_embeds
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 4, 8, generator=generator)
    text = torch.randn(2, 6, 96, generator=generator)
    sigmas = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = Flux2Klein().predict(model, latents, sigmas, {"prompt_embeds": text})
        patchified = pipe._patchify_latents(latents)
        ids = pipe._prepare_latent_ids(patchified)
        tokens = model(
            hidden_states=pipe._pack_latents(patchified),
            encoder_hidden_states=text,
            timestep=sigmas,
            guidance=None,
            img_ids=ids,
            txt_ids=pipe._prepare_text_ids(text),
            return_dict=False,
        )[0]
    theirs = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(tokens, ids))
    torch.testing.assert_close(ours, theirs)


def test_samples_are_the_pipelines(pipe):
    validation = SimpleNamespace(height=32, width=32, steps=2, guidance=4.0)
    ours = Flux2Klein().sample(pipe, ["a red fox"], validation, torch.Generator().manual_seed(0))
    theirs = pipe(
        prompt=["a red fox"], height=32, width=32, num_inference_steps=2, guidance_scale=4.0,
        max_sequence_length=64, text_encoder_out_layers=(1, 2, 3),
        generator=torch.Generator().manual_seed(0), output_type="pt",
    ).images  # fmt: skip
    assert ours.shape == (1, 3, 32, 32)
    torch.testing.assert_close(ours, theirs)
