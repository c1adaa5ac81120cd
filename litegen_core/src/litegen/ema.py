"""Exponential moving average of a trainable model's weights.

The average lives in FP32 beside the model and is updated with one fused ``lerp`` pass and no
communication. This first version keeps a full replica on every rank.
"""

from __future__ import annotations

import torch
from torch import nn


class EMA:
    """An FP32 moving average of ``model``'s parameters (and a copy of its buffers).

    Example:
        >>> ema = EMA(model)
        >>> ema.update(model, decay=0.999)
        >>> ema.state_dict()["weight"].dtype
        torch.float32
    """

    def __init__(self, model: nn.Module) -> None:
        self.names = [name for name, _ in model.named_parameters()]
        self.params = [p.detach().float().clone() for _, p in model.named_parameters()]
        self.buffer_names = [name for name, _ in model.named_buffers()]
        self.buffers = [b.detach().clone() for _, b in model.named_buffers()]

    @torch.no_grad()
    def update(self, model: nn.Module, decay: float) -> None:
        current = [p.detach().float() for p in model.parameters()]
        # ema = decay * ema + (1 - decay) * param, all tensors in one foreach kernel.
        torch._foreach_lerp_(self.params, current, 1.0 - decay)
        for mine, theirs in zip(self.buffers, model.buffers(), strict=True):
            mine.copy_(theirs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {n: p.cpu() for n, p in zip(self.names, self.params, strict=True)}
        state.update({n: b.cpu() for n, b in zip(self.buffer_names, self.buffers, strict=True)})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in zip(
            self.names + self.buffer_names, self.params + self.buffers, strict=True
        ):
            tensor.copy_(state[name])

    def dcp_state(self) -> dict[str, torch.Tensor]:
        """The tensors DCP saves and loads in place (no copies)."""
        return dict(zip(self.names + self.buffer_names, self.params + self.buffers, strict=True))

    def load_dcp_state(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to do: ``dcp.load`` already wrote into the tensors of :meth:`dcp_state`."""
