"""Wan 2.2: the A14B family's two experts (routing by timestep, each expert's noise levels, the
expert of each step, one export per expert that diffusers loads into its own transformer) and
TI2V-5B (the Wan 2.2 VAE's latent rules, per-token timesteps, the clean first frame)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from litegen.config.finetune import FinetuneConfig
from litegen.families import family_for_pipeline, family_for_transformer
from litegen.families.wan import Wan
from litegen.families.wan22 import Wan22
from litegen.families.wan22_ti2v import FIRST_FRAME, Wan22TI2V
from litegen.objectives import FlowMatching

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from litegen.finetune.expert_models import (  # noqa: E402
    Experts,
    ExpertSchedule,
    RangeFlowMatching,
    range_mass,
    write_expert_exports,
)
from litegen.finetune.experts import expert_problems  # noqa: E402
from tests.pipelines import tiny_pipeline_folder  # noqa: E402

TWO_EXPERTS = {"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875}


def tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return diffusers.WanTransformer3DModel(**Wan.tiny_config).eval()


def inputs(timestep: float, batch: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, 4, 2, 4, 4, generator=generator),
        "timestep": torch.full((batch,), timestep),
        "encoder_hidden_states": torch.randn(batch, 6, 32, generator=generator),
    }


def test_the_registry_tells_the_wan_families_apart_by_model_index() -> None:
    assert family_for_pipeline("WanPipeline") is Wan
    assert family_for_pipeline("WanPipeline", TWO_EXPERTS) is Wan22
    assert family_for_pipeline("WanPipeline", {"expand_timesteps": True}) is Wan22TI2V
    assert family_for_pipeline("WanPipeline", {"transformer_2": [None, None]}) is Wan
    folder = tiny_pipeline_folder("wan22")
    index = json.loads((folder / "model_index.json").read_text())
    assert family_for_pipeline(index["_class_name"], index) is Wan22
    assert index["boundary_ratio"] == Wan22.boundary_ratio
    # The transformer class is Wan 2.1's: by class alone the registry finds Wan 2.1.
    assert family_for_transformer(Wan22.transformer_class) is Wan


def test_experts_route_by_timestep_as_the_pipeline_does() -> None:
    high, low = tiny(0), tiny(1)
    experts = Experts({"transformer": high, "transformer_2": low}, boundary_timestep=875.0)
    with torch.no_grad():
        for timestep, expert in ((875.0, high), (990.0, high), (874.9, low), (10.0, low)):
            got = experts(**inputs(timestep), return_dict=False)[0]
            torch.testing.assert_close(got, expert(**inputs(timestep), return_dict=False)[0])
        with pytest.raises(ValueError, match=r"straddle the experts' boundary 875\.0"):
            experts(**{**inputs(0), "timestep": torch.tensor([900.0, 100.0])})
    only_high = Experts({"transformer": high}, boundary_timestep=875.0)
    with pytest.raises(ValueError, match="served by transformer_2, which this run does not"):
        only_high(**inputs(100.0))


@pytest.mark.parametrize("density", ["uniform", "logit_normal", "mode"])
def test_each_expert_draws_the_density_truncated_to_its_range(density: str) -> None:
    objective = FlowMatching(density=density, shift=3.0)
    torch.manual_seed(0)
    full = objective.sample_sigmas(200_000)
    for low, high in ((0.875, 1.0), (0.0, 0.875)):
        ranged = RangeFlowMatching(density=density, shift=3.0, sigma_min=low, sigma_max=high)
        sigmas = ranged.sample_sigmas(50_000)
        assert bool(((sigmas >= low) & (sigmas <= high)).all())
        inside = full[(full >= low) & (full <= high)]
        # The truncated draws are the full density's draws that fall in the range.
        quantiles = torch.tensor([0.1, 0.5, 0.9])
        torch.testing.assert_close(sigmas.quantile(quantiles), inside.quantile(quantiles),
                                   atol=0.01, rtol=0)  # fmt: skip
        share = len(inside) / len(full)
        assert abs(range_mass(objective, low, high) - share) < 0.01


def test_the_expert_of_each_step_follows_the_range_mass_and_repeats() -> None:
    objective = FlowMatching(density="logit_normal", shift=3.0)
    schedule = ExpertSchedule(boundary=0.875, trained=("high", "low"), seed=3)
    drawn = [schedule.expert_at(step, objective) for step in range(1, 4001)]
    again = ExpertSchedule(boundary=0.875, trained=("high", "low"), seed=3)
    assert drawn == [again.expert_at(step, objective) for step in range(1, 4001)]  # resume
    share = drawn.count("high") / len(drawn)
    assert abs(share - range_mass(objective, 0.875, 1.0)) < 0.03
    assert ExpertSchedule(0.875, ("low",)).expert_at(5, objective) == "low"
    assert schedule.objective(1, objective).sigma_min == (0.875 if drawn[0] == "high" else 0.0)


def test_training_a_step_steps_its_expert_alone() -> None:
    from litegen.finetune.training import CaptionDropout, train_step

    experts = Experts({"transformer": tiny(0), "transformer_2": tiny(1)}, 875.0).train()
    schedule = ExpertSchedule(boundary=0.875, trained=("high", "low"), seed=0)
    objective = FlowMatching(density="logit_normal", shift=3.0)
    batch = {"latents": inputs(0)["hidden_states"],
             "prompt_embeds": inputs(0)["encoder_hidden_states"]}  # fmt: skip
    for step in (1, 2, 3, 4):
        experts.zero_grad(set_to_none=True)
        train_step(batch, experts, Wan22(), objective, CaptionDropout(0.0, {}), schedule, step)\
            .backward()  # fmt: skip
        component = (
            "transformer" if schedule.expert_at(step, objective) == "high" else "transformer_2"
        )
        for name, module in experts.named_children():
            grads = [p.grad is not None for p in module.parameters()]
            assert all(grads) if name == component else not any(grads)


def test_a_bad_expert_name_or_experts_of_a_one_transformer_pipeline_are_refused() -> None:
    with pytest.raises(ValueError, match=r"field 'experts.0': Input should be 'high' or 'low'"):
        FinetuneConfig.model_validate({"experts": ["middle"]})
    config = SimpleNamespace(finetune=SimpleNamespace(experts=["low"], pipeline="tiny_wan"))
    (problem,) = expert_problems(config, {"_class_name": "WanPipeline"})
    assert problem.startswith("field 'finetune.experts': ['low'] names experts, but")
    assert expert_problems(config, TWO_EXPERTS) == []


def test_each_expert_export_loads_into_its_own_transformer(tmp_path: Path) -> None:
    from litegen.config.sections import LoRAConfig
    from litegen.finetune.export import write_export
    from litegen.lora import apply_lora

    folder = tiny_pipeline_folder("wan22")
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    lora = LoRAConfig(rank=4, alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    trained = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
    generator = torch.Generator().manual_seed(1)
    for module in trained.values():
        apply_lora(module, lora)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    experts = Experts(trained, 875.0)
    write_expert_exports(experts, experts.state_dict(), folder, tmp_path, name="run",
                         lora_prefix="transformer", write_one=write_export)  # fmt: skip
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"run.{e}_noise.{kind}" for e in ("high", "low")
                     for kind in ("lora.safetensors", "original.lora.safetensors", "peft")]  # fmt: skip
    for kind in ("lora", "original.lora"):
        fresh = diffusers.WanPipeline.from_pretrained(folder)
        fresh.load_lora_weights(str(tmp_path / f"run.high_noise.{kind}.safetensors"))
        fresh.load_lora_weights(str(tmp_path / f"run.low_noise.{kind}.safetensors"),
                                load_into_transformer_2=True)  # fmt: skip
        for component, timestep in (("transformer", 900.0), ("transformer_2", 100.0)):
            with torch.no_grad():
                want = trained[component].eval()(**inputs(timestep), return_dict=False)[0]
                got = getattr(fresh, component).eval()(**inputs(timestep), return_dict=False)[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ti2v_latents_follow_the_wan22_vae() -> None:
    pipe = Wan22TI2V.tiny_pipeline()
    index = {"expand_timesteps": pipe.config.expand_timesteps}
    assert family_for_pipeline("WanPipeline", index) is Wan22TI2V
    assert Wan22TI2V.latent.spatial_multiple == 32
    assert Wan22TI2V().temporal_compression(dict(pipe.vae.config)) == 4
    pixels = torch.rand(1, 3, 5, 64, 32) * 2 - 1
    with torch.no_grad():
        latents = Wan22TI2V().encode_latents(pipe, pixels, micro_batch_size=1)
    assert latents.shape == (1, pipe.vae.config.z_dim, 2, 4, 2)  # 16x in space, 4x in time


def test_ti2v_keeps_the_first_frame_clean_at_timestep_zero() -> None:
    family, model = Wan22TI2V(), tiny(0)
    objective = FlowMatching(density="logit_normal", shift=3.0)
    x = inputs(0)
    image = torch.randn(2, 4, 1, 4, 4, generator=torch.Generator().manual_seed(5))
    batch = {"latents": x["hidden_states"], "prompt_embeds": x["encoder_hidden_states"],
             FIRST_FRAME: image}  # fmt: skip
    torch.manual_seed(7)
    loss = family.loss(model, batch, objective)

    # The same loss written out: latent frame 0 is the image's, at timestep 0; the other
    # tokens at sigma * 1000; the loss over the noised frames only.
    torch.manual_seed(7)
    x0 = batch["latents"]
    noise = torch.randn_like(x0)
    sigmas = objective.sample_sigmas(2)
    noisy = (1 - sigmas.view(2, 1, 1, 1, 1)) * x0 + sigmas.view(2, 1, 1, 1, 1) * noise
    noisy[:, :, :1] = image
    tokens = (4 // 2) * (4 // 2)
    timestep = (sigmas * 1000).view(2, 1).repeat(1, 2 * tokens)
    timestep[:, :tokens] = 0
    prediction = model(hidden_states=noisy, timestep=timestep,
                       encoder_hidden_states=batch["prompt_embeds"], return_dict=False)[0]  # fmt: skip
    want = ((prediction - (noise - x0)) ** 2)[:, :, 1:].mean()
    torch.testing.assert_close(loss, want)

    # Without the first frame, a per-token timestep of one value is the per-sample one.
    text_only = {k: v for k, v in batch.items() if k != FIRST_FRAME}
    torch.manual_seed(7)
    t2v = family.loss(model, text_only, objective)
    torch.manual_seed(7)
    torch.testing.assert_close(t2v, Wan().loss(model, text_only, objective))


def test_ti2v_encodes_its_image_and_samples_from_it() -> None:
    from PIL import Image

    family, pipe = Wan22TI2V(), Wan22TI2V.tiny_pipeline()
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        first = family.encode_condition(pipe, "image", pixels, pixels[:, :, None], 1)[FIRST_FRAME]
        alone = family.encode_latents(pipe, pixels[:, :, None], 1)
    torch.testing.assert_close(first, alone)
    assert first.shape == (1, 4, 1, 2, 2)
    validation = SimpleNamespace(height=32, width=32, steps=2, guidance=1.0, frames=5)
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    videos = family.sample(pipe, ["a red square"], validation, torch.Generator().manual_seed(0),
                           conditions={"image": [image]})  # fmt: skip
    assert videos.shape == (1, 3, 5, 32, 32)


def test_i2v_a14b_is_found_by_model_index_and_conditions_as_its_pipeline() -> None:
    from litegen.families.wan import WanI2V
    from litegen.families.wan22 import Wan22I2V

    pipe = Wan22I2V.tiny_pipeline()
    index = {"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.9}
    assert family_for_pipeline("WanImageToVideoPipeline", index) is Wan22I2V
    assert family_for_pipeline("WanImageToVideoPipeline") is WanI2V
    assert pipe.image_encoder is None and pipe.config.boundary_ratio == 0.9
    clip = torch.rand(1, 3, 5, 32, 48) * 2 - 1
    family = Wan22I2V()
    with torch.no_grad():
        encoded = family.encode_condition(pipe, "image", clip[:, :, 0], clip, 1)
        _, condition = pipe.prepare_latents(
            clip[:, :, 0], 1, 4, 32, 48, 5, torch.float32, torch.device("cpu")
        )
    assert encoded.keys() == {"first_frame"}
    torch.testing.assert_close(encoded["first_frame"], condition)

    # predict: noise, mask and first frame on channels, no image embedding.
    model = pipe.transformer
    noisy = torch.randn(1, 4, 2, 4, 6)
    text = torch.randn(1, 6, 32)
    batch = {"prompt_embeds": text, **encoded}
    with torch.no_grad():
        got = family.predict(model, noisy, torch.tensor([0.95]), batch)
        want = model(hidden_states=torch.cat([noisy, condition], dim=1),
                     timestep=torch.tensor([950.0]), encoder_hidden_states=text,
                     return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(got, want)
