"""The weighted mean squared error both objectives reduce to."""

from __future__ import annotations

import torch


def weighted_mse(
    prediction: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over each sample's elements, times its weight, mean over the batch (in FP32).

    Example:
        >>> pred, target = torch.zeros(2, 3), torch.ones(2, 3)
        >>> weighted_mse(pred, target, torch.tensor([1.0, 3.0]))
        tensor(2.)
    """
    if prediction.shape != target.shape:
        raise ValueError(
            f"prediction shape {tuple(prediction.shape)} differs from target shape "
            f"{tuple(target.shape)}: the model must predict a tensor shaped like its input."
        )
    per_sample = (prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1)
    if weight is not None:
        per_sample = per_sample * weight.float().reshape(-1)
    return per_sample.mean()
