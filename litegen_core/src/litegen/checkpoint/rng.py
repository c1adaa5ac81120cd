"""The global RNG states a run checkpoint saves per rank, and the trainer's hooks set aside.

Example:
    >>> state = capture_rng(torch.device("cpu"))
    >>> first = torch.rand(1)
    >>> restore_rng(state)
    >>> torch.equal(torch.rand(1), first)
    True
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """Every global RNG state that training draws from on this rank.

    Example:
        >>> state = capture_rng()
        >>> first = torch.rand(1)
        >>> restore_rng(state)
        >>> torch.equal(torch.rand(1), first)
        True
    """
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's key is an array; a list keeps the file loadable with weights_only=True.
        "numpy": {**np_state, "state": {k: _plain(v) for k, v in np_state["state"].items()}},
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Put back what :func:`capture_rng` returned."""
    random.setstate(_as_tuple(state["python"]))
    np_state = dict(state["numpy"])
    np_state["state"] = {
        k: np.asarray(v, dtype=np.uint32) if k == "key" else v for k, v in np_state["state"].items()
    }
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value
