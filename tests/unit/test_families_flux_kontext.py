"""The Flux.1 Kontext family checked against FluxKontextPipeline's own code: the reference's
latents are the pipeline's, the training forward is the pipeline's transformer call over the
noisy target's tokens then the reference's (ids with first axis 1) cut back to the target's, the
loss counts the target only, and samples come from the pipeline with a reference image."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from litegen.families import family_for_pipeline, family_for_transformer
from litegen.families.flux import Flux
from litegen.families.flux_kontext import REFERENCE, FluxKontext
from litegen.objectives import FlowMatching
from tests.pipelines import tiny_pipeline_folder

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def pipe():
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pretrained(tiny_pipeline_folder("flux_kontext"))


def batch(generator: torch.Generator, reference_size=(4, 6)) -> dict[str, torch.Tensor]:
    return {
        "prompt_embeds": torch.randn(2, 6, 32, generator=generator),
        "pooled": torch.randn(2, 32, generator=generator),
        REFERENCE: torch.randn(2, 4, *reference_size, generator=generator),
    }


def test_kontext_is_a_variant_of_flux_found_by_its_pipeline():
    assert family_for_pipeline("FluxKontextPipeline") is FluxKontext
    # The shared transformer class answers Flux: one key map and plan for both.
    assert family_for_transformer("FluxTransformer2DModel") is Flux
    assert FluxKontext.original_keys is Flux.original_keys
    assert FluxKontext.media_conditions["reference"].required


def test_the_reference_latents_are_the_pipelines(pipe):
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    family = FluxKontext(pipe.scheduler.config)
    ours = family.encode_condition(pipe, "reference", pixels, pixels, micro_batch_size=1)
    theirs = pipe._encode_vae_image(pixels, generator=None)
    assert ours.keys() == {REFERENCE}
    torch.testing.assert_close(ours[REFERENCE], theirs)


def test_forward_is_the_pipelines_call_cut_to_the_target(pipe):
    from diffusers import FluxKontextPipeline as P

    model = pipe.transformer
    generator = torch.Generator().manual_seed(1)
    conditions = batch(generator)
    noisy = torch.randn(2, 4, 4, 4, generator=generator)
    sigmas = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = FluxKontext().predict(model, noisy, sigmas, conditions)
        target = P._pack_latents(noisy, 2, 4, 4, 4)
        reference = P._pack_latents(conditions[REFERENCE], 2, 4, 4, 6)
        target_ids = P._prepare_latent_image_ids(2, 2, 2, "cpu", torch.float32)
        reference_ids = P._prepare_latent_image_ids(2, 2, 3, "cpu", torch.float32)
        reference_ids[..., 0] = 1
        tokens = model(
            hidden_states=torch.cat([target, reference], dim=1),
            timestep=sigmas,
            guidance=None,
            pooled_projections=conditions["pooled"],
            encoder_hidden_states=conditions["prompt_embeds"],
            txt_ids=torch.zeros(6, 3),
            img_ids=torch.cat([target_ids, reference_ids]),
            return_dict=False,
        )[0]
    theirs = P._unpack_latents(tokens[:, : target.shape[1]], 32, 32, 8)
    torch.testing.assert_close(ours, theirs)


def test_the_loss_counts_the_target_and_trains_through_the_reference(pipe):
    """The reference changes the prediction (it is attended to) but is never a target: the
    loss is the flow-matching loss of the target's velocity alone."""
    model = pipe.transformer
    generator = torch.Generator().manual_seed(2)
    conditions = batch(generator)
    x0 = torch.randn(2, 4, 4, 4, generator=generator)
    objective = FlowMatching(density="uniform")
    family = FluxKontext(pipe.scheduler.config)
    torch.manual_seed(3)
    loss = family.loss(model, {"latents": x0, **conditions}, objective)
    torch.manual_seed(3)
    noise = torch.randn_like(x0)
    sigmas = objective.sample_sigmas(2, shift=family.shift_for(4))
    noisy = objective.add_noise(x0, noise, sigmas)
    by_hand = objective.loss(family.predict(model, noisy, sigmas, conditions), x0, noise, sigmas)
    torch.testing.assert_close(loss, by_hand)
    other = {**conditions, REFERENCE: conditions[REFERENCE] + 1}
    with torch.no_grad():
        moved = family.predict(model, noisy, sigmas, other) - family.predict(
            model, noisy, sigmas, conditions
        )
    assert moved.abs().max() > 1e-4


def test_samples_edit_each_prompts_reference(pipe):
    from PIL import Image

    validation = SimpleNamespace(height=32, width=48, steps=2, guidance=2.5)
    references = [Image.new("RGB", (48, 32), (200, 30, 30)), Image.new("RGB", (48, 32), "blue")]
    images = FluxKontext().sample(
        pipe, ["make it green", "a fox"], validation, torch.Generator().manual_seed(0),
        conditions={"reference": references},
    )  # fmt: skip
    assert images.shape == (2, 3, 32, 48)
    direct = pipe(
        image=references[0], prompt="make it green", height=32, width=48, num_inference_steps=2,
        guidance_scale=2.5, max_sequence_length=32, generator=torch.Generator().manual_seed(0),
        output_type="pt", _auto_resize=False, max_area=32 * 48,
    ).images  # fmt: skip
    torch.testing.assert_close(images[:1], direct)
    with pytest.raises(ValueError, match=r"trainer\.validation\.conditions\.reference"):
        FluxKontext().sample(pipe, ["a fox"], validation, torch.Generator(), conditions=None)
