"""Objectives agree with the diffusers schedulers the pipelines sample with."""

from __future__ import annotations

import math

import pytest
import torch

from litegen.objectives import (
    FlowMatching,
    NoisePrediction,
    ddpm_alphas_cumprod,
    resolution_shift,
    sample_density,
    shift_sigmas,
    weighted_mse,
)

diffusers = pytest.importorskip("diffusers")
training_utils = pytest.importorskip("diffusers.training_utils")


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_flow_sigmas_and_timesteps_match_the_scheduler(shift: float) -> None:
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    objective = FlowMatching.from_scheduler_config(scheduler.config)
    unshifted = torch.arange(1000, 0, -1, dtype=torch.float32) / 1000
    sigmas = shift_sigmas(unshifted, objective.shift)
    torch.testing.assert_close(sigmas, scheduler.sigmas)
    torch.testing.assert_close(objective.timesteps(sigmas), scheduler.timesteps)


def test_wan_unipc_flow_config_gives_its_flow_shift() -> None:
    scheduler = diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    objective = FlowMatching.from_scheduler_config(scheduler.config)
    assert objective.shift == 3.0
    scheduler.set_timesteps(10)
    unshifted = torch.linspace(1, 1 / 1000, 11)[:-1]
    ours = shift_sigmas(unshifted, objective.shift)
    torch.testing.assert_close(ours[1:], scheduler.sigmas[1:-1])  # its first is 1 - 1e-6
    with pytest.raises(ValueError, match="NoisePrediction"):
        FlowMatching.from_scheduler_config(diffusers.DDPMScheduler().config)


def test_resolution_shift_matches_the_dynamic_scheduler() -> None:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    objective = FlowMatching.from_scheduler_config(scheduler.config)
    assert objective.shift == 1.0  # shifted per resolution at sampling time, not by `shift`
    grid = torch.linspace(1.0, 0.05, 8).tolist()
    for seq_len in (256, 1024, 4096):
        mu = calculate_shift(seq_len)
        assert resolution_shift(seq_len) == pytest.approx(math.exp(mu))
        scheduler.set_timesteps(sigmas=grid, mu=mu)
        ours = shift_sigmas(torch.tensor(grid), resolution_shift(seq_len))
        torch.testing.assert_close(ours, scheduler.sigmas[:-1])


def test_flow_noising_and_velocity_agree_with_scale_noise_and_euler_step() -> None:
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    objective = FlowMatching.from_scheduler_config(scheduler.config)
    generator = torch.Generator().manual_seed(0)
    x0, noise = (
        torch.randn(3, 4, 6, 6, generator=generator),
        torch.randn(3, 4, 6, 6, generator=generator),
    )
    for i in (0, 4, 8):
        sigma, next_sigma = scheduler.sigmas[i], scheduler.sigmas[i + 1]
        t = scheduler.timesteps[i]
        noisy = objective.add_noise(x0, noise, sigma.expand(3))
        torch.testing.assert_close(noisy, scheduler.scale_noise(x0, t.expand(3), noise))
        # The exact velocity moves a sample along the path to the next noise level.
        scheduler._step_index = i
        stepped = scheduler.step(objective.target(x0, noise), t, noisy).prev_sample
        torch.testing.assert_close(stepped, objective.add_noise(x0, noise, next_sigma.expand(3)))


@pytest.mark.parametrize("density", ["uniform", "logit_normal", "mode"])
def test_densities_match_diffusers_draws(density: str) -> None:
    ours = sample_density(
        density,
        64,
        logit_mean=0.3,
        logit_std=1.2,
        mode_scale=1.29,
        generator=torch.Generator().manual_seed(3),
    )
    theirs = training_utils.compute_density_for_timestep_sampling(
        density,
        64,
        logit_mean=0.3,
        logit_std=1.2,
        mode_scale=1.29,
        generator=torch.Generator().manual_seed(3),
    )
    torch.testing.assert_close(ours, theirs)


def test_logit_normal_concentrates_in_the_middle_and_shift_moves_toward_noise() -> None:
    generator = torch.Generator().manual_seed(0)
    uniform = FlowMatching().sample_sigmas(20000, generator=generator)
    logit = FlowMatching(density="logit_normal").sample_sigmas(20000, generator=generator)
    shifted = FlowMatching(density="logit_normal", shift=3.0).sample_sigmas(
        20000, generator=generator
    )
    middle = lambda s: ((s > 0.25) & (s < 0.75)).float().mean()  # noqa: E731
    assert middle(logit) > middle(uniform) + 0.1
    assert shifted.mean() > logit.mean() + 0.1


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_flow_loss_weights_match_diffusers(weighting: str) -> None:
    sigmas = torch.linspace(0.05, 0.95, 7)
    ours = FlowMatching(weighting=weighting).loss_weight(sigmas)
    theirs = training_utils.compute_loss_weighting_for_sd3(weighting, sigmas)
    torch.testing.assert_close(ours, theirs)


def test_flow_loss_is_the_weighted_velocity_error() -> None:
    objective = FlowMatching(weighting="cosmap")
    x0, noise = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    sigmas = torch.tensor([0.2, 0.7])
    assert objective.loss(objective.target(x0, noise), x0, noise, sigmas) == 0
    zero = torch.zeros_like(x0)
    expected = ((noise - x0) ** 2).mean(dim=(1, 2)) * objective.loss_weight(sigmas)
    torch.testing.assert_close(objective.loss(zero, x0, noise, sigmas), expected.mean())


@pytest.mark.parametrize(
    "config",
    [
        {"beta_schedule": "linear"},
        {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012},
        {"beta_schedule": "squaredcos_cap_v2"},
        {"beta_schedule": "scaled_linear", "beta_end": 0.012, "rescale_betas_zero_snr": True},
    ],
)
def test_ddpm_schedule_matches_the_scheduler(config: dict) -> None:
    scheduler = diffusers.DDPMScheduler(**config)
    ours = NoisePrediction.from_scheduler_config(scheduler.config).alphas_cumprod
    torch.testing.assert_close(ours, scheduler.alphas_cumprod)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_ddpm_noising_and_targets_match_the_scheduler(prediction_type: str) -> None:
    scheduler = diffusers.DDPMScheduler(
        beta_schedule="scaled_linear", prediction_type=prediction_type
    )
    objective = NoisePrediction.from_scheduler_config(scheduler.config)
    assert objective.prediction_type == prediction_type
    generator = torch.Generator().manual_seed(1)
    x0, noise = (
        torch.randn(4, 3, 5, 5, generator=generator),
        torch.randn(4, 3, 5, 5, generator=generator),
    )
    t = objective.sample_timesteps(4, generator=generator)
    noisy = objective.add_noise(x0, noise, t)
    torch.testing.assert_close(noisy, scheduler.add_noise(x0, noise, t))
    expected = {
        "epsilon": noise,
        "v_prediction": scheduler.get_velocity(x0, noise, t),
        "sample": x0,
    }[prediction_type]
    torch.testing.assert_close(objective.target(x0, noise, t), expected)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_match_the_diffusers_training_scripts(prediction_type: str) -> None:
    scheduler = diffusers.DDPMScheduler(prediction_type=prediction_type)
    objective = NoisePrediction.from_scheduler_config(scheduler.config, snr_gamma=5.0)
    t = torch.tensor([0, 10, 100, 500, 999])
    snr = training_utils.compute_snr(scheduler, t)
    torch.testing.assert_close(objective.snr(t), snr)
    # The weights of diffusers' train_text_to_image.py with --snr_gamma 5.
    weights = torch.stack([snr, 5.0 * torch.ones_like(t)], dim=1).min(dim=1)[0]
    weights = weights / snr if prediction_type == "epsilon" else weights / (snr + 1)
    torch.testing.assert_close(objective.loss_weight(t), weights)


def test_ddpm_alphas_default_is_the_linear_schedule() -> None:
    torch.testing.assert_close(ddpm_alphas_cumprod(), diffusers.DDPMScheduler().alphas_cumprod)


def test_bad_names_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="logit_normal"):
        FlowMatching(density="lognormal")
    with pytest.raises(ValueError, match="cosmap"):
        FlowMatching(weighting="snr")
    with pytest.raises(ValueError, match="v_prediction"):
        NoisePrediction(ddpm_alphas_cumprod(), prediction_type="flow")
    with pytest.raises(ValueError, match="beta_schedule"):
        ddpm_alphas_cumprod(beta_schedule="sigmoid")
    with pytest.raises(ValueError, match="target shape"):
        weighted_mse(torch.zeros(2, 3), torch.zeros(2, 4))
