"""Training objectives of diffusion models: what to noise, what to predict, how to weigh it.

- :class:`FlowMatching` (``flow_matching.py``): rectified flow, ``x_t = (1 - σ) x_0 + σ ε`` with
  target ``ε - x_0``, the objective of SD3, Flux, Wan, LTX-Video and HunyuanVideo; σ drawn by
  :func:`sample_density` (uniform, logit-normal, mode) and moved by the shift of
  :func:`shift_sigmas` (fixed, or :func:`resolution_shift` from the sequence length).
- :class:`NoisePrediction` (``noise_prediction.py``): DDPM-style objectives (epsilon,
  v-prediction, sample) over ``alphas_cumprod``, with min-SNR loss weighting.

Both agree with the diffusers schedulers the pipelines sample with
(``FlowMatchEulerDiscreteScheduler``, ``DDPMScheduler``) and are built from their configs with
``from_scheduler_config``. The user's ``train_step`` calls them; nothing here touches a model.
"""

from litegen.objectives.flow_matching import (
    FlowMatching,
    resolution_shift,
    sample_density,
    shift_sigmas,
)
from litegen.objectives.noise_prediction import NoisePrediction, ddpm_alphas_cumprod
from litegen.objectives.weighting import weighted_mse

__all__ = [
    "FlowMatching",
    "NoisePrediction",
    "ddpm_alphas_cumprod",
    "resolution_shift",
    "sample_density",
    "shift_sigmas",
    "weighted_mse",
]
