"""The lab, behind one door: kernels that patch private or beta APIs of torch or CUDA libraries.

Each feature is switched on by ``optimization.experimental`` only, and runs only on the torch
release it was tested on (:data:`TESTED_TORCH`); on any other release it steps aside with a
one-line warning and the run continues with LiteGen's ordinary code. The core never imports
this package: ``prepare`` (``litegen.runtime.litegen``) opens the door when a feature is set,
and the features plug into the core's own extension points (a module swap, a compiled block's
context, the master-weight optimizer's kernel). Which feature plugs in where, and with which
function, is the table :data:`litegen.experimental.switches.SWITCHES`; what each one does is
in ``ExperimentalConfig`` and docs/performance.md.

Example::

    from litegen.experimental import Lab
    lab = Lab(config.optimization.experimental, compile_options={})
    lab.swap_modules(model)                 # before checkpointing and compile
    compile_blocks(model, cfg, block_contexts=lab.block_contexts())
    lab.configure_optimizer(optimizer)      # after the strategy wrapped it
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from litegen.experimental.switches import SWITCHES, Switch, is_on

log = logging.getLogger("litegen")

# feature -> the torch releases (major.minor) its kernels were tested on, on GPU.
TESTED_TORCH: dict[str, tuple[str, ...]] = {s.name: s.tested_torch for s in SWITCHES}


def torch_release() -> str:
    """``major.minor`` of the running torch, e.g. ``'2.11'``."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def available(feature: str) -> bool:
    """Whether ``feature`` may run on this torch; warns once per feature when it may not.

    Example:
        >>> available("master_adamw")  # on torch 2.13: False, with a warning
        False
    """
    tested = TESTED_TORCH[feature]
    if torch_release() in tested:
        return True
    if feature not in _warned:
        _warned.add(feature)
        warnings.warn(
            f"optimization.experimental.{feature} is tested on torch {', '.join(tested)} only; "
            f"it is off on torch {torch.__version__}.",
            stacklevel=3,
        )
    return False


_warned: set[str] = set()


class Lab:
    """The experimental features one ``optimization.experimental`` section switches on.

    ``compile_options`` are ``optimization.compile.options`` (inductor's), which some
    features must not override.
    """

    def __init__(self, settings: Any, compile_options: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.compile_options = compile_options or {}

    def _running(self, hook: str) -> list[tuple[Switch, Any]]:
        """The switches on ``hook`` that are on and may run here, with their hooks' targets."""
        running = []
        for switch in SWITCHES:
            if switch.hook != hook or not is_on(getattr(self.settings, switch.name)):
                continue
            if available(switch.name):
                running.append((switch, _load(switch.target)))
        return running

    def swap_modules(self, model: nn.Module) -> int:
        """Route the model's modules through the fused ones its module swaps ask for.

        Returns how many modules were swapped.
        """
        return sum(
            self._swap(model, switch, apply) for switch, apply in self._running("module_swap")
        )

    def _swap(self, model: nn.Module, switch: Switch, apply: Callable[[nn.Module], int]) -> int:
        fused = apply(model)
        log.info("%s: %d %s fused", type(model).__name__, fused, switch.swaps)
        if not fused:
            log.warning(
                "optimization.experimental.%s: %s has %s (see docs/performance.md); nothing was "
                "fused.",
                switch.name,
                type(model).__name__,
                switch.absent,
            )
        return fused

    def block_contexts(self) -> list[Callable[[], AbstractContextManager]]:
        """What compiled blocks enter around each call: one per block-context switch on."""
        return [
            make(getattr(self.settings, switch.name), self.compile_options)
            for switch, make in self._running("block_context")
        ]

    def configure_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step FP32 master weights with the kernel of the master-step switch that is on."""
        from litegen.optim import set_master_step_kernel

        for _, kernel in self._running("master_step"):
            set_master_step_kernel(optimizer, kernel)


def _load(target: str) -> Any:
    """The attribute a ``"module:attribute"`` target names (imported on first use)."""
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


__all__ = ["SWITCHES", "TESTED_TORCH", "Lab", "available", "torch_release"]
