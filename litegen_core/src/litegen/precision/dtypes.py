"""Whole-model dtype casts (``optimization.precision.cast_model``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from litegen.model_parts.paths import is_under, submodules_at

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def cast_model(model: nn.Module, dtype: str, exclude_paths: Iterable[str] = ()) -> nn.Module:
    """Cast every floating parameter and buffer to ``dtype``, except under ``exclude_paths``.

    Example:
        >>> model = nn.ModuleDict({"block": nn.Linear(4, 4), "final_layer": nn.Linear(4, 4)})
        >>> model = cast_model(model, "bf16", exclude_paths=["final_layer"])
        >>> model["block"].weight.dtype, model["final_layer"].weight.dtype
        (torch.bfloat16, torch.float32)
    """
    target = DTYPES[dtype]
    excluded = list(
        submodules_at(model, exclude_paths, "optimization.precision.cast_exclude_paths")
    )
    for name, module in model.named_modules():
        if is_under(name, excluded):
            continue
        for tensors in (module._parameters, module._buffers):
            for key, tensor in tensors.items():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != target:
                    # In place on .data keeps Parameter identity, so optimizers built on the
                    # model's parameters before prepare still point at them.
                    tensor.data = tensor.data.to(target)
                    tensors[key] = tensor
    return model


def fsdp2_mixed_policy(cfg) -> torch.distributed.fsdp.MixedPrecisionPolicy:
    """``optimization.precision.fsdp_mixed`` as torch's ``MixedPrecisionPolicy`` (fsdp2/hsdp).

    Unset dtypes stay ``None``, which torch reads as "keep the storage/gradient dtype".

    Example:
        >>> from litegen.config.sections import FSDPMixedConfig
        >>> fsdp2_mixed_policy(FSDPMixedConfig(param_dtype="bf16", reduce_dtype="fp32"))
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ...)
    """

    # Imported here so DDP-only jobs never load the FSDP package.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def dtype(name: str | None) -> torch.dtype | None:
        return None if name is None else DTYPES[name]

    return MixedPrecisionPolicy(
        param_dtype=dtype(cfg.param_dtype),
        reduce_dtype=dtype(cfg.reduce_dtype),
        output_dtype=dtype(cfg.output_dtype),
        cast_forward_inputs=cfg.cast_forward_inputs,
    )
