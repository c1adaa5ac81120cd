"""Every model family of litegen.families: its tiny transformer builds, the registry finds it by
pipeline and transformer class, its training loss runs and backpropagates, its forward agrees
with a call written out by hand, and its sequence-parallel plan is the one plans.py serves."""

from __future__ import annotations

import pytest
import torch

from litegen.families import families, family_for_pipeline, family_for_transformer, family_named
from litegen.families.flux import Flux
from litegen.families.wan import Wan
from litegen.objectives import FlowMatching

diffusers = pytest.importorskip("diffusers")


def tiny_transformer(family):
    torch.manual_seed(0)
    return getattr(diffusers, family.transformer_class)(**family.tiny_config)


def tiny_batch(family, batch: int = 2) -> dict[str, torch.Tensor]:
    """Cached-sample shapes: latents of 4 channels (2 frames for a video family) and text."""
    generator = torch.Generator().manual_seed(0)
    frames = (2,) if family.latent.is_video else ()
    config = family.tiny_config
    text = (
        config.get("text_dim")
        or config.get("caption_channels")
        or config.get("text_embed_dim")
        or config["joint_attention_dim"]
    )
    out = {
        "latents": torch.randn(batch, 4, *frames, 4, 4, generator=generator),
        "prompt_embeds": torch.randn(batch, 6, text, generator=generator),
    }
    if "prompt_embeds_mask" in family.conditions:
        out["prompt_embeds_mask"] = torch.ones(batch, 6, dtype=torch.long)
    if "prompt_embeds_2" in family.conditions:  # HunyuanVideo 1.5's glyph text
        out["prompt_embeds_2"] = torch.randn(batch, 4, config["text_embed_2_dim"])
        out["prompt_embeds_mask_2"] = torch.ones(batch, 4, dtype=torch.long)
    if "pooled" in family.conditions:
        pooled = family.tiny_config["pooled_projection_dim"]
        out["pooled"] = torch.randn(batch, pooled, generator=generator)
    if family.media_conditions:
        out |= media_condition_tensors(family, out["latents"].shape, generator)
    return out


def media_condition_tensors(family, latent_shape, generator) -> dict[str, torch.Tensor]:
    """The tensors of the family's media conditions for latents of ``latent_shape``, encoded
    by its tiny pipeline from random pixels of the matching size, and its text tensors (a
    family with conditions may need its own text length: Wan I2V's 512 tokens)."""
    pipe = family.tiny_pipeline()
    rules = family.latent
    size = [side * rules.spatial_compression for side in latent_shape[-2:]]
    frames = [(latent_shape[2] - 1) * rules.temporal_compression + 1] if rules.is_video else []
    clip = torch.rand(latent_shape[0], 3, *frames, *size, generator=generator) * 2 - 1
    first = clip[:, :, 0] if rules.is_video else clip
    given = {
        name: clip if condition.kind == "video" else first
        for name, condition in family.media_conditions.items()
    }
    with torch.no_grad():  # Qwen-Image-Edit's text encoder reads the reference too
        out = family({}).encode_text_with(pipe, ["a fox"] * latent_shape[0], given)
        for name, pixels in given.items():
            out |= family({}).encode_condition(pipe, name, pixels, clip, micro_batch_size=2)
    return out


def test_the_registry_holds_the_families_and_names_them_when_asked_for_another():
    assert set(families()) >= {"wan", "flux"}
    for name, family in families().items():
        assert family_named(name) is family
        # Families sharing a pipeline class (Wan 2.1, Wan 2.2) differ by model_index.json.
        model_index = dict.fromkeys(family.model_index_keys, True)
        assert family_for_pipeline(family.pipeline_class, model_index) is family
        # Families of one transformer class (Wan T2V and I2V) share its key map and plan.
        found = family_for_transformer(family.transformer_class)
        assert found.transformer_class == family.transformer_class
        assert found.original_keys is family.original_keys
        assert found.sequence_plan.__func__ is family.sequence_plan.__func__
    with pytest.raises(ValueError, match=r"no model family trains a CogVideoXPipeline; the "
                       r"families are flux \(FluxPipeline\), .*wan \(WanPipeline\)"):  # fmt: skip
        family_for_pipeline("CogVideoXPipeline")
    with pytest.raises(ValueError, match="the families are flux"):
        family_for_transformer("SD3Transformer2DModel")


@pytest.mark.parametrize("name", sorted(families()))
def test_the_tiny_transformer_trains_on_the_family_loss(name):
    family = families()[name]
    model = tiny_transformer(family)
    assert type(model).__name__ == family.transformer_class
    objective = FlowMatching(density="logit_normal")
    torch.manual_seed(0)
    loss = family().loss(model, tiny_batch(family), objective)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and all(g is not None for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_wan_forward_is_the_transformer_at_timesteps_of_1000():
    model, batch = tiny_transformer(Wan), tiny_batch(Wan)
    sigmas = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = Wan().predict(model, batch["latents"], sigmas, batch)
        theirs = model(batch["latents"], timestep=torch.tensor([250.0, 750.0]),
                       encoder_hidden_states=batch["prompt_embeds"], return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(ours, theirs)


def test_flux_forward_packs_as_the_pipeline_and_unpacks_its_prediction():
    from diffusers import FluxPipeline

    model, batch = tiny_transformer(Flux), tiny_batch(Flux)
    latents, sigmas = batch["latents"], torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = Flux().predict(model, latents, sigmas, batch)
        tokens = model(
            hidden_states=FluxPipeline._pack_latents(latents, 2, 4, 4, 4),
            timestep=sigmas,
            pooled_projections=batch["pooled"],
            encoder_hidden_states=batch["prompt_embeds"],
            txt_ids=torch.zeros(6, 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(2, 2, 2, "cpu", torch.float32),
            return_dict=False,
        )[0]
    # The pipeline's unpack (it takes pixel sizes: 8x the latents').
    theirs = FluxPipeline._unpack_latents(tokens, 32, 32, 8)
    torch.testing.assert_close(ours, theirs)


def test_qwen_image_edit_forward_is_the_pipelines_call_cut_to_the_target():
    """The edit pipeline's transformer call: the noisy target's packed tokens then the
    reference's, one img_shapes entry each, the text with its mask; the target's part unpacked."""
    from diffusers import QwenImageEditPipeline as P

    from litegen.families.qwen_image_edit import REFERENCE, QwenImageEdit

    model, batch = tiny_transformer(QwenImageEdit), tiny_batch(QwenImageEdit)
    batch[REFERENCE] = torch.randn(2, 4, 6, 4, generator=torch.Generator().manual_seed(3))
    text, mask = batch["prompt_embeds"], batch["prompt_embeds_mask"]
    mask[1, -2:] = 0  # a shorter second caption
    latents, sigmas = batch["latents"], torch.tensor([0.25, 0.75])
    with torch.no_grad():
        ours = QwenImageEdit().predict(model, latents, sigmas, batch)
        target = P._pack_latents(latents, 2, 4, 4, 4)
        reference = P._pack_latents(batch[REFERENCE], 2, 4, 6, 4)
        tokens = model(
            hidden_states=torch.cat([target, reference], dim=1),
            timestep=sigmas,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, 2, 2), (1, 3, 2)]] * 2,
            return_dict=False,
        )[0]
    # The pipeline's unpack (pixel sizes: 8x the latents'), its frame axis dropped.
    theirs = P._unpack_latents(tokens[:, : target.shape[1]], 32, 32, 8)[:, :, 0]
    torch.testing.assert_close(ours, theirs)


def test_wan_encodes_images_as_one_frame_clips():
    """max_frames=1 on a video family: images come as (B, C, H, W) and train as one frame."""
    pipe = Wan.tiny_pipeline()
    latents = Wan().encode_latents(pipe, torch.zeros(2, 3, 32, 32), micro_batch_size=2)
    assert latents.shape == (2, 4, 1, 4, 4)


def test_the_sequence_plans_come_from_the_families():
    from litegen.parallel.sequence.builtin_plans import plan_for
    from litegen.parallel.sequence.sequence_plan import Split

    wan = tiny_transformer(Wan)
    plan = plan_for(wan)
    assert plan == Wan.sequence_plan(wan)
    assert plan.split_inputs == {
        "": {"timestep": Split(1, ndim=2)},
        "blocks.0": {"hidden_states": 1},
    }
    assert plan.split_outputs == {"rope": {0: 1, 1: 1}}
    assert plan.gather_outputs == {"proj_out": 1}
    assert plan.attention == {"blocks.*.attn1": "self"}
    # Flux declares none: the lookup falls back to the plan diffusers' _cp_plan gives.
    flux = tiny_transformer(Flux)
    assert Flux.sequence_plan(flux) is None
    assert plan_for(flux).attention
    # A model with neither: the lookup says so and names the classes that have one.
    with pytest.raises(
        ValueError, match=r"needs a sequence-parallel plan for Linear.*WanTransformer3DModel"
    ):
        plan_for(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", sorted(families()))
def test_the_tiny_pipeline_holds_the_family_classes(name):
    family = families()[name]
    pipe = family.tiny_pipeline()
    assert type(pipe).__name__ == family.pipeline_class
    assert type(pipe.transformer).__name__ == family.transformer_class
    components = {k for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
    assert components == {*family.trained, *family.frozen}


def test_the_key_map_of_a_sharded_transformer_is_its_class_s():
    """fully_shard turns a model's class into a subclass FSDP<Class>: its export still finds
    the original layout (the end-of-run export of an fsdp2 LoRA run writes that file)."""
    from litegen.families import key_map_for, original_format_classes

    wan = tiny_transformer(Wan)
    wan.__class__ = type("FSDPWanTransformer3DModel", (type(wan),), {})
    assert key_map_for(wan) is Wan.original_keys
    assert original_format_classes() == sorted(set(original_format_classes()))


@pytest.mark.parametrize("name", ["wan_i2v", "ltx_video_i2v", "flux_kontext", "qwen_image_edit"])
def test_a_conditioned_sample_without_one_file_per_prompt_names_the_setting(name):
    family = family_named(name)()
    condition = next(iter(family.media_conditions))
    with pytest.raises(ValueError, match=rf"trainer\.validation\.conditions\.{condition}") as err:
        family.sample(None, ["a cat", "a dog"], None, None, {condition: ["one.png"]})
    assert "(1 for 2 prompts)" in str(err.value)
