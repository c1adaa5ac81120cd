"""FP8 training of a model's ``nn.Linear`` layers through torchao's float8 (an optional extra).

``optimization.precision.fp8_linear`` (``tensorwise`` or ``rowwise``, torchao's recipe names)
converts the trainable model's eligible ``nn.Linear`` layers with
``torchao.float8.convert_to_float8_training``: their matmuls run in FP8 with dynamic scales,
the weights and optimizer stay in their dtype. ``prepare`` converts before checkpointing,
compile and the strategy's wrap, as torchao asks. A layer is eligible when both its dimensions
are multiples of 16 (FP8 GEMMs need them); the token dimension is padded to one where the
batch does not give it.

Where it cannot run (no CUDA device, a GPU below compute capability 8.9, torchao not installed)
it steps aside with one warning and the model trains in its own precision.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import Literal

import torch
from torch import nn

log = logging.getLogger("litegen")

Recipe = Literal["tensorwise", "rowwise"]

# FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
MIN_CAPABILITY = (8, 9)


def fp8_unavailable(device: torch.device) -> str | None:
    """Why FP8 training cannot run on ``device`` here, or None when it can.

    Example:
        >>> fp8_unavailable(torch.device("cpu"))
        'the device is cpu, and FP8 matmuls need a CUDA GPU'
    """
    if device.type != "cuda":
        return f"the device is {device.type}, and FP8 matmuls need a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"the GPU has compute capability {capability[0]}.{capability[1]}, and FP8 matmuls "
            f"need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer"
        )
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (the litegen-core[torchao] extra)"
    return None


def _eligible(module: nn.Module, path: str) -> bool:
    return (
        type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0
    )


def apply_fp8_training(model: nn.Module, recipe: Recipe, device: torch.device) -> int:
    """Convert ``model``'s eligible ``nn.Linear`` layers to torchao's float8 training layers, in
    place; returns how many were converted (0 where FP8 cannot run, after one warning).

    Example::

        apply_fp8_training(dit, "rowwise", torch.device("cuda"))
    """
    reason = fp8_unavailable(torch.device(device))
    if reason is not None:
        log.warning(
            "optimization.precision.fp8_linear: %s; training %s in its own precision.",
            reason,
            type(model).__name__,
        )
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    before = sum(1 for path, m in model.named_modules() if _eligible(m, path))
    # FP8 GEMMs need every contracted dimension a multiple of 16, and the weight gradient's is
    # the layer's token count (batch x sequence), which the data sets: pad it where it is not.
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    convert_to_float8_training(model, module_filter_fn=_eligible, config=config)
    return before
