"""What a ``LiteGen.prepare`` call was passed, sorted, and the record of each model it returns.

The kind of each argument (model, optimizer, dataset, DataLoader; anything else is refused),
the model each optimizer steps, which models are trained and which frozen, and
:class:`PreparedModel`. ``LiteGen.prepare`` (``runtime/litegen.py``) then processes models
first, the optimizers that depend on them next, then datasets, and returns the results in the
order the arguments were given.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from litegen.parallel.base import Strategy


@dataclass
class PreparedModel:
    """A model after ``prepare``, with the strategy that owns it."""

    module: nn.Module
    strategy: Strategy
    trainable: bool
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    # Per optimizer, its param groups' parameter names in the user's order (before wrapping):
    # what the numbers of a plain optimizer.state_dict() refer to (checkpoint/interop.py).
    param_names: list[list[list[str]]] = field(default_factory=list)
    # An unwrapped copy for strategies whose EMA is a wrapped copy (fsdp1); dropped once used.
    ema_template: nn.Module | None = None
    # What activation checkpointing and offload did (litegen.memory.MemoryReport).
    memory: Any = None


def kind_of(obj: Any, position: int) -> str:
    """'model', 'optimizer', 'dataloader' or 'dataset'; anything else is a user mistake."""
    kind = preparable_kind(obj)
    if kind is not None:
        return kind
    raise TypeError(
        f"prepare argument {position} is a {type(obj).__module__}.{type(obj).__qualname__}; "
        "prepare accepts models (torch.nn.Module), optimizers (torch.optim.Optimizer), "
        "datasets and DataLoaders. Call functions such as vae.encode inside your train step, "
        "on the prepared model."
    )


def preparable_kind(obj: Any) -> str | None:
    """The kind of object ``prepare`` takes, or None for anything it does not take."""
    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, DataLoader):
        return "dataloader"
    if isinstance(obj, Dataset) or (
        hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not callable(obj)
    ):
        return "dataset"
    return None


def is_trainable(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def trained_models(models: list[nn.Module], optimizer_owners: Iterable[int]) -> list[bool]:
    """Which of one ``prepare`` call's models are trained; the others are frozen.

    A model is trained when some parameter requires grad and, if the call passes optimizers,
    one of them steps it. So ``prepare(model, optimizer, vae, dataset)`` trains ``model`` and
    freezes ``vae``; ``prepare(model)`` alone trains ``model`` (an optimizer built afterwards on
    the prepared parameters). Freeze a model prepared on its own with ``requires_grad_(False)``.
    A frozen model is never wrapped or sharded: it comes back as the same module, on the device,
    in eval mode, with ``requires_grad`` off (``Strategy.wrap_frozen_model``).

    Example:
        >>> model, vae = nn.Linear(4, 4), nn.Linear(4, 4)
        >>> trained_models([model, vae], optimizer_owners=[0])
        [True, False]
    """
    owners = set(optimizer_owners)
    return [is_trainable(m) and (not owners or i in owners) for i, m in enumerate(models)]


def owner_of(optimizer: torch.optim.Optimizer, position: int, models: list[nn.Module]) -> int:
    """Index of the one model whose parameters the optimizer steps."""
    param_ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [
        i for i, model in enumerate(models) if param_ids & {id(p) for p in model.parameters()}
    ]
    if len(owners) != 1:
        found = "no prepared model" if not owners else f"{len(owners)} models"
        raise ValueError(
            f"prepare argument {position} (an optimizer) steps parameters of {found}; pass "
            "each optimizer together with the one model whose parameters it was built on."
        )
    return owners[0]


def fqns_of(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name, captured before wrapping changes the parameters."""
    return {id(p): name for name, p in model.named_parameters()}
