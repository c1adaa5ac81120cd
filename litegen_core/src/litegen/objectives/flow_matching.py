"""Flow matching (rectified flow): the straight path from data to noise and its velocity.

``x_σ = (1 - σ) x_0 + σ ε`` for a noise level ``σ`` in ``[0, 1]``; the model predicts the
velocity ``ε - x_0`` at timestep ``1000 σ``. This is what diffusers'
``FlowMatchEulerDiscreteScheduler`` integrates at sampling time (``scale_noise`` is the path,
``step`` an Euler step along the predicted velocity), so a model trained on it samples with the
pipeline unchanged.

Where ``σ`` is drawn matters more than anything else here: :func:`sample_density` gives the
draws of the SD3 paper (uniform, logit-normal, mode), and :func:`shift_sigmas` moves them toward
noise as the scheduler's ``shift`` does (SD3 uses 3, Wan 5 for 720p, LTX-Video and Flux derive
it from the sequence length: :func:`resolution_shift`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch

from litegen.objectives.weighting import weighted_mse

Density = Literal["uniform", "logit_normal", "mode"]
FlowWeighting = Literal["none", "sigma_sqrt", "cosmap"]


def sample_density(
    density: Density,
    batch_size: int,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``batch_size`` draws in ``[0, 1]`` from one of the SD3 paper's timestep densities.

    ``uniform``; ``logit_normal``: ``sigmoid(N(logit_mean, logit_std))``, most draws in the
    middle; ``mode``: a heavier middle set by ``mode_scale``. The same generator gives the same
    draws as diffusers' ``compute_density_for_timestep_sampling``.

    Example:
        >>> u = sample_density("logit_normal", 4, generator=torch.Generator().manual_seed(0))
        >>> u.shape, bool(((u > 0) & (u < 1)).all())
        (torch.Size([4]), True)
    """
    if density == "logit_normal":
        normal = torch.normal(
            logit_mean, logit_std, size=(batch_size,), generator=generator, device=device
        )
        return torch.sigmoid(normal)
    if density not in ("uniform", "mode"):
        raise ValueError(
            f"unknown timestep density {density!r}: use 'uniform', 'logit_normal' or 'mode'."
        )
    u = torch.rand(batch_size, generator=generator, device=device)
    if density == "mode":
        u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """``shift σ / (1 + (shift - 1) σ)``: noise levels moved toward 1 for ``shift > 1``.

    The scheduler's ``shift`` (SD3, Wan, HunyuanVideo) and, with ``shift = exp(mu)``, its
    exponential resolution shift (Flux, LTX-Video).

    Example:
        >>> shift_sigmas(torch.tensor([0.0, 0.5, 1.0]), 3.0)
        tensor([0.0000, 0.7500, 1.0000])
    """
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def resolution_shift(
    seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """The shift Flux and LTX-Video sample with for ``seq_len`` latent tokens.

    ``exp(mu)`` with ``mu`` linear in the sequence length between ``(base_seq_len,
    base_shift)`` and ``(max_seq_len, max_shift)``, as the pipelines' ``calculate_shift``;
    pass the scheduler config's ``base_image_seq_len``, ``max_image_seq_len``, ``base_shift``,
    ``max_shift``.

    Example:
        >>> round(resolution_shift(256), 4) == round(math.exp(0.5), 4)
        True
    """
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return math.exp(base_shift + slope * (seq_len - base_seq_len))


@dataclasses.dataclass(frozen=True)
class FlowMatching:
    """Rectified-flow training: draw noise levels, noise the latents, compare velocities.

    Example:
        >>> objective = FlowMatching(density="logit_normal", shift=3.0)
        >>> x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
        >>> sigmas = objective.sample_sigmas(2, generator=torch.Generator().manual_seed(0))
        >>> noisy = objective.add_noise(x0, noise, sigmas)
        >>> timesteps = objective.timesteps(sigmas)  # what the transformer is given
        >>> prediction = torch.zeros_like(x0)  # model(noisy, timesteps, ...)
        >>> loss = objective.loss(prediction, x0, noise, sigmas)
    """

    num_train_timesteps: int = 1000
    density: Density = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 1.0
    weighting: FlowWeighting = "none"

    def __post_init__(self) -> None:
        sample_density(self.density, 0)  # a bad name fails at construction, not at step 1
        if self.shift <= 0:
            raise ValueError(f"FlowMatching.shift must be > 0, got {self.shift}.")
        if self.weighting not in ("none", "sigma_sqrt", "cosmap"):
            raise ValueError(
                f"unknown flow-matching weighting {self.weighting!r}: "
                "use 'none', 'sigma_sqrt' or 'cosmap'."
            )

    @classmethod
    def from_scheduler_config(cls, config: Mapping[str, Any], **options: Any) -> FlowMatching:
        """The objective a flow-matching scheduler config samples with.

        Takes ``num_train_timesteps`` and the shift: ``shift`` of
        ``FlowMatchEulerDiscreteScheduler`` (SD3, Flux, LTX-Video, HunyuanVideo) or
        ``flow_shift`` of a multistep scheduler with ``use_flow_sigmas`` (UniPC, as Wan's
        published pipelines have). A config with ``use_dynamic_shifting`` (Flux, LTX-Video)
        shifts by resolution at sampling time, so training starts unshifted and
        :meth:`sample_sigmas` takes ``shift=resolution_shift(seq_len, ...)`` to match it.
        ``options`` set the other fields (``density``, ``weighting``, ...). A DDPM-style config
        (``prediction_type`` epsilon, v_prediction or sample) is refused: use
        :class:`~litegen.objectives.NoisePrediction`.

        Example:
            >>> FlowMatching.from_scheduler_config({"shift": 5.0}, density="logit_normal").shift
            5.0
            >>> FlowMatching.from_scheduler_config({"use_flow_sigmas": True, "flow_shift": 3.0}).shift
            3.0
        """
        prediction = config.get("prediction_type")
        if prediction in ("epsilon", "v_prediction", "sample") and not config.get(
            "use_flow_sigmas"
        ):
            raise ValueError(
                f"the scheduler config predicts {prediction!r}, not a flow: train it with "
                "NoisePrediction.from_scheduler_config, or give a flow-matching scheduler config."
            )
        shift = config.get("shift", config.get("flow_shift", 1.0))
        fields: dict[str, Any] = {
            "num_train_timesteps": int(config.get("num_train_timesteps", 1000)),
            "shift": 1.0 if config.get("use_dynamic_shifting") else float(shift),
        }
        return cls(**{**fields, **options})

    def sample_sigmas(
        self,
        batch_size: int,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
        shift: float | None = None,
    ) -> torch.Tensor:
        """Noise levels for a batch: draws of :attr:`density`, shifted (``shift`` overrides)."""
        u = sample_density(
            self.density,
            batch_size,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            mode_scale=self.mode_scale,
            generator=generator,
            device=device,
        )
        return shift_sigmas(u, self.shift if shift is None else shift)

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The timesteps the pipelines give the transformer for ``sigmas``."""
        return sigmas * self.num_train_timesteps

    @staticmethod
    def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """``(1 - σ) x_0 + σ ε`` per sample (the scheduler's ``scale_noise``)."""
        sigma = _per_sample(sigmas, x0)
        return (1 - sigma) * x0 + sigma * noise

    @staticmethod
    def target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The velocity ``ε - x_0`` the model predicts."""
        return noise - x0

    def loss_weight(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Per-sample weights of :attr:`weighting` (diffusers' ``compute_loss_weighting_for_sd3``)."""
        if self.weighting == "sigma_sqrt":
            return sigmas.float() ** -2.0
        if self.weighting == "cosmap":
            return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
        return torch.ones_like(sigmas)

    def loss(
        self,
        prediction: torch.Tensor,
        x0: torch.Tensor,
        noise: torch.Tensor,
        sigmas: torch.Tensor,
    ) -> torch.Tensor:
        """The weighted mean squared error of the predicted velocity."""
        return weighted_mse(prediction, self.target(x0, noise), self.loss_weight(sigmas))


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (one per sample) shaped to broadcast over ``like``'s sample dimensions."""
    return values.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))
