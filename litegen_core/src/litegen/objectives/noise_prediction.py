"""DDPM-style objectives: ``x_t = √ᾱ_t x_0 + √(1 - ᾱ_t) ε`` over integer timesteps.

The model predicts the noise (``epsilon``), the velocity ``√ᾱ_t ε - √(1 - ᾱ_t) x_0``
(``v_prediction``) or ``x_0`` itself (``sample``), as the pipeline's scheduler config says in
``prediction_type``. ``ᾱ`` (``alphas_cumprod``) comes from the same beta schedules as diffusers'
``DDPMScheduler`` (:func:`ddpm_alphas_cumprod`), so the noisy inputs and targets are the
scheduler's ``add_noise`` and ``get_velocity``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch

from litegen.objectives.weighting import weighted_mse

PredictionType = Literal["epsilon", "v_prediction", "sample"]
BetaSchedule = Literal["linear", "scaled_linear", "squaredcos_cap_v2"]


def ddpm_alphas_cumprod(
    num_train_timesteps: int = 1000,
    *,
    beta_start: float = 0.0001,
    beta_end: float = 0.02,
    beta_schedule: BetaSchedule = "linear",
    rescale_betas_zero_snr: bool = False,
) -> torch.Tensor:
    """``ᾱ_t`` for ``t = 0 .. num_train_timesteps - 1``, as ``DDPMScheduler`` computes it.

    ``linear`` (DDPM), ``scaled_linear`` (Stable Diffusion: linear in ``√β``),
    ``squaredcos_cap_v2`` (the cosine schedule); ``rescale_betas_zero_snr`` makes the last
    timestep pure noise.

    Example:
        >>> a = ddpm_alphas_cumprod(1000, beta_schedule="scaled_linear", beta_end=0.012)
        >>> a.shape, bool((a[1:] < a[:-1]).all())
        (torch.Size([1000]), True)
    """
    if beta_schedule == "linear":
        betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)
    elif beta_schedule == "scaled_linear":
        betas = torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps) ** 2
    elif beta_schedule == "squaredcos_cap_v2":

        def alpha_bar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

        n = num_train_timesteps
        betas = torch.tensor(
            [min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999) for i in range(n)],
            dtype=torch.float32,
        )
    else:
        raise ValueError(
            f"unsupported beta_schedule {beta_schedule!r}: use 'linear', 'scaled_linear' or "
            "'squaredcos_cap_v2', or pass alphas_cumprod to NoisePrediction yourself."
        )
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    if rescale_betas_zero_snr:
        root = alphas_cumprod.sqrt()
        first, last = root[0].clone(), root[-1].clone()
        alphas_cumprod = ((root - last) * first / (first - last)) ** 2
    return alphas_cumprod


@dataclasses.dataclass(frozen=True, eq=False)
class NoisePrediction:
    """Epsilon, v- or sample-prediction training over a DDPM noise schedule.

    ``snr_gamma`` turns on min-SNR weighting (``min(SNR, γ) / SNR`` for epsilon,
    ``/ (SNR + 1)`` for v-prediction), 5.0 in the paper.

    Example:
        >>> objective = NoisePrediction(ddpm_alphas_cumprod(), prediction_type="v_prediction")
        >>> x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
        >>> t = objective.sample_timesteps(2, generator=torch.Generator().manual_seed(0))
        >>> noisy = objective.add_noise(x0, noise, t)
        >>> prediction = torch.zeros_like(x0)  # model(noisy, t, ...)
        >>> loss = objective.loss(prediction, x0, noise, t)
    """

    alphas_cumprod: torch.Tensor
    prediction_type: PredictionType = "epsilon"
    snr_gamma: float | None = None

    def __post_init__(self) -> None:
        if self.prediction_type not in ("epsilon", "v_prediction", "sample"):
            raise ValueError(
                f"unknown prediction_type {self.prediction_type!r}: "
                "use 'epsilon', 'v_prediction' or 'sample'."
            )
        if self.snr_gamma is not None and self.snr_gamma <= 0:
            raise ValueError(
                f"snr_gamma must be > 0 (or None for no weighting), got {self.snr_gamma}."
            )

    @classmethod
    def from_scheduler_config(cls, config: Mapping[str, Any], **options: Any) -> NoisePrediction:
        """The objective of a ``DDPMScheduler``-family config (DDIM, Euler, ... share it).

        Example:
            >>> config = {"beta_schedule": "scaled_linear", "beta_end": 0.012,
            ...           "prediction_type": "v_prediction"}
            >>> NoisePrediction.from_scheduler_config(config, snr_gamma=5.0).prediction_type
            'v_prediction'
        """
        if config.get("trained_betas") is not None:
            betas = torch.tensor(config["trained_betas"], dtype=torch.float32)
            alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        else:
            alphas_cumprod = ddpm_alphas_cumprod(
                int(config.get("num_train_timesteps", 1000)),
                beta_start=float(config.get("beta_start", 0.0001)),
                beta_end=float(config.get("beta_end", 0.02)),
                beta_schedule=config.get("beta_schedule", "linear"),
                rescale_betas_zero_snr=bool(config.get("rescale_betas_zero_snr", False)),
            )
        fields = {"prediction_type": config.get("prediction_type", "epsilon")}
        return cls(alphas_cumprod, **{**fields, **options})

    @property
    def num_train_timesteps(self) -> int:
        return len(self.alphas_cumprod)

    def sample_timesteps(
        self,
        batch_size: int,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Uniform integer timesteps in ``[0, num_train_timesteps)``."""
        return torch.randint(
            0, self.num_train_timesteps, (batch_size,), generator=generator, device=device
        )

    def _scales(self, timesteps: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        alpha_bar = self.alphas_cumprod.to(like.device)[timesteps.to(like.device)]
        shape = (-1, *([1] * (like.dim() - 1)))
        signal = alpha_bar.sqrt().to(like.dtype).reshape(shape)
        noise = (1 - alpha_bar).sqrt().to(like.dtype).reshape(shape)
        return signal, noise

    def add_noise(
        self, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """``√ᾱ_t x_0 + √(1 - ᾱ_t) ε`` (the scheduler's ``add_noise``)."""
        signal, sigma = self._scales(timesteps, x0)
        return signal * x0 + sigma * noise

    def target(
        self, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """What the model predicts under :attr:`prediction_type`."""
        if self.prediction_type == "epsilon":
            return noise
        if self.prediction_type == "sample":
            return x0
        signal, sigma = self._scales(timesteps, x0)
        return signal * noise - sigma * x0

    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        """The signal-to-noise ratio ``ᾱ_t / (1 - ᾱ_t)`` of each timestep."""
        alpha_bar = self.alphas_cumprod.to(timesteps.device)[timesteps].float()
        return alpha_bar / (1 - alpha_bar)

    def loss_weight(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Min-SNR weights with :attr:`snr_gamma`, else ones."""
        if self.snr_gamma is None:
            return torch.ones(timesteps.shape, device=timesteps.device)
        snr = self.snr(timesteps)
        clipped = snr.clamp(max=self.snr_gamma)
        if self.prediction_type == "epsilon":
            return clipped / snr
        if self.prediction_type == "v_prediction":
            return clipped / (snr + 1)
        return clipped

    def loss(
        self,
        prediction: torch.Tensor,
        x0: torch.Tensor,
        noise: torch.Tensor,
        timesteps: torch.Tensor,
    ) -> torch.Tensor:
        """The weighted mean squared error of the prediction."""
        target = self.target(x0, noise, timesteps)
        return weighted_mse(prediction, target, self.loss_weight(timesteps))
