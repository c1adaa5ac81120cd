"""The typed sections of ``MainConfig`` for training: EMA and the trainer's loop, logs and hooks.

Import the public names from :mod:`litegen.config`. Like every config module, this one never
imports torch (the CLI imports it for fast validation).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from litegen.config.base import Section


class EMAConfig(Section):
    """Exponential moving average of the trainable model (``ema``)."""

    enable: bool = False
    sharded: bool = True
    decay: float = Field(0.9999, ge=0.0, le=1.0)
    resume_from: str | None = None


class ProfileConfig(Section):
    """A torch profiler window over training steps (``trainer.profile``)."""

    start: int = Field(..., ge=1, description="the first profiled step (steps count from 1)")
    steps: int = Field(..., ge=1, description="how many steps to profile")


class WandbConfig(Section):
    """Weights & Biases options (``trainer.wandb``), read when ``trainer.loggers`` has wandb."""

    project: str | None = Field(None, description="None: the run's exp_name")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: everything stays under <results_dir>/wandb"
    )


class ValidationConfig(Section):
    """What the ``sample()`` hook generates every ``sample_every`` steps (``trainer.validation``).

    The fine-tuning recipes hand these to the pipeline they sample with; a hook of your own
    reads them from ``config.trainer.validation``. None leaves the pipeline's own default.
    """

    prompts: list[str] = Field(default_factory=list, description="the prompts sampled")
    steps: int | None = Field(None, ge=1, description="denoising steps")
    guidance: float | None = Field(None, ge=0, description="classifier-free guidance scale")
    height: int | None = Field(None, ge=1, description="pixels")
    width: int | None = Field(None, ge=1, description="pixels")
    frames: int | None = Field(None, ge=1, description="frames of a video")
    seed: int = Field(0, description="seeds the sampling generator; the training RNG is untouched")
    conditions: dict[str, list[str]] = Field(
        default_factory=dict,
        description="media condition name (image, reference, control_video) -> one file per "
        "prompt, for a model that takes them",
    )


class TrainerConfig(Section):
    """Training-loop settings read by LiteGen's trainer (``trainer``)."""

    grad_accum_steps: int = Field(1, ge=1)
    max_grad_norm: float | None = Field(None, gt=0)
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="0: no periodic checkpoint")
    save_final: bool = True
    export_diffusers: bool = Field(
        False, description="at the end, write <results_dir>/diffusers/ for from_pretrained"
    )
    export_ema: bool = Field(True, description="export_diffusers: the EMA weights when ema.enable")
    keep_last: int | None = Field(None, ge=1, description="None: keep every checkpoint")
    async_checkpoint: bool = Field(
        False, description="write run checkpoints in the background (dcp.async_save)"
    )
    resume_run: str | None = Field(
        None, description="run checkpoint (step_<N> folder or checkpoint_dir) to continue from"
    )
    on_nan: Literal["abort", "skip"] = "abort"
    autocast: Literal["bf16", "fp16"] | None = None
    peak_tflops: float | None = Field(
        None, gt=0, description="peak FLOP/s per GPU for MFU; None: the known-GPU table"
    )
    tokens_per_sample: int | None = Field(
        None, ge=1, description="for tokens/s; None: the model's tokens_per_sample, if any"
    )
    sample_every: int = Field(
        0, ge=0, description="steps between calls of the entry's sample() hook; 0: never"
    )
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    validate_every: int = Field(
        0, ge=0, description="steps between calls of the entry's validate() hook; 0: never"
    )
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="where metrics go; metrics.jsonl is always written",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    profile: ProfileConfig | None = Field(
        None, description="torch profiler trace and summary for steps start..start+steps-1"
    )
