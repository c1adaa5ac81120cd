"""Fixes added to errors a training step raises, when a setting may be their cause.

Example:
    >>> config = MainConfig(optimization={"precision": {"cast_model": "bf16"}})
    >>> cast_model_hint(config, RuntimeError("expected BFloat16 but found Float"))
    "optimization.precision.cast_model is bf16: it casts the model's parameters, not the batch. ..."
"""

from __future__ import annotations

import re

from litegen.config import MainConfig


def cast_model_hint(config: MainConfig, exc: RuntimeError) -> str | None:
    """The fix for a dtype mismatch that ``cast_model`` without autocast causes, if it may be one.

    ``cast_model`` casts the parameters, not the batch, so FP32 inputs reach bf16 weights; torch
    then names the two dtypes but not the setting behind them. Only torch's plain
    ``RuntimeError`` naming both FP32 and the cast dtype gets the hint, re-raised with it.
    """
    cast = config.optimization.precision.cast_model
    if type(exc) is not RuntimeError or cast in (None, "fp32") or config.trainer.autocast:
        return None
    names = {"bf16": ("BFloat16", "bfloat16"), "fp16": ("Half", "float16")}[cast]
    message = str(exc)
    fp32 = re.search(r"\b[Ff]loat(?!16)", message)  # Float, float, FloatTensor; not BFloat16
    if not (fp32 and any(name in message for name in names)):
        return None
    return (
        f"optimization.precision.cast_model is {cast}: it casts the model's parameters, not the "
        f"batch. Set trainer.autocast: {cast}, which casts FP32 inputs in the forward, or cast "
        "the inputs in train_step."
    )


__all__ = ["cast_model_hint"]
