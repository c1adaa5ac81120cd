"""The lab, behind one door: kernels that patch private or beta APIs of torch or CUDA libraries.

Each feature is switched on by ``optimization.experimental`` only, and runs only on the torch
release it was tested on (:data:`TESTED_TORCH`); on any other release it steps aside with a
one-line warning and the run continues with LiteGen's ordinary code. The core never imports
this package: ``prepare`` (``litegen.runtime.litegen``) opens the door when a feature is set,
and the features plug into the core's own extension points (a compiled block's context, the
master-weight optimizer's kernel, a module swap).

- ``persistent_rows``: one-pass Triton norms with fixed launch configs in compiled blocks
  (:mod:`.row_reductions`; subclasses inductor's ``InductorChoices``);
- ``fused_gelu_mlp``: the GELU of Linear-GELU-Linear MLPs in cuBLASLt's GEMM epilogues
  (:mod:`.gelu_mlp`, :mod:`.mlp_fusion`; cuBLASLt through ctypes);
- ``master_adamw``: FP32 master AdamW in one Triton pass for all parameters
  (:mod:`.master_adamw`);
- ``fused_wan_attention``: Wan's self-attention with one QKV GEMM and its query and key norms
  and rotary embedding in one Triton pass (:mod:`.wan_attention`, :mod:`.qk_norm_rope`; a
  diffusers processor swap).

Example::

    from litegen.experimental import Lab
    lab = Lab(config.optimization.experimental, compile_options={})
    lab.swap_modules(model)                 # before checkpointing and compile
    compile_blocks(model, cfg, block_contexts=[lab.block_context()])
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

log = logging.getLogger("litegen")

# feature -> the torch releases (major.minor) its kernels were tested on, on GPU.
TESTED_TORCH: dict[str, tuple[str, ...]] = {
    "persistent_rows": ("2.11",),
    "fused_gelu_mlp": ("2.11",),
    "master_adamw": ("2.11",),
    "fused_wan_attention": ("2.11",),
}


# feature -> the module and function that swap a model's modules, what they swap, and what a
# model without any lacks.
_MODULE_SWAPS: dict[str, tuple[str, str, str, str]] = {
    "fused_gelu_mlp": (
        "litegen.experimental.mlp_fusion",
        "apply_fused_gelu_mlp",
        "GELU MLPs",
        "no Linear-GELU(tanh)-Linear MLP that can be fused",
    ),
    "fused_wan_attention": (
        "litegen.experimental.wan_attention",
        "apply_fused_wan_attention",
        "Wan self-attention layers",
        "no diffusers Wan self-attention layer",
    ),
}


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

    def swap_modules(self, model: nn.Module) -> int:
        """Route the model's GELU MLPs and Wan self-attention layers through the fused ops.

        Returns how many modules were swapped.
        """
        return sum(self._swap(model, feature) for feature in _MODULE_SWAPS)

    def _swap(self, model: nn.Module, feature: str) -> int:
        if not getattr(self.settings, feature) or not available(feature):
            return 0
        module, function, swapped, none = _MODULE_SWAPS[feature]
        fused = getattr(importlib.import_module(module), function)(model)
        log.info("%s: %d %s fused", type(model).__name__, fused, swapped)
        if not fused:
            log.warning(
                "optimization.experimental.%s: %s has %s (see docs/performance.md); nothing was "
                "fused.",
                feature,
                type(model).__name__,
                none,
            )
        return fused

    def block_context(self) -> Callable[[], AbstractContextManager] | None:
        """What compiled blocks enter around each call (``persistent_rows``), or None."""
        rows = self.settings.persistent_rows
        if rows is None or not available("persistent_rows"):
            return None
        from litegen.experimental.row_reductions import persistent_rows_context

        return persistent_rows_context(rows, self.compile_options)

    def configure_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step FP32 master weights with the one-pass kernel (``master_adamw``)."""
        if not self.settings.master_adamw or not available("master_adamw"):
            return
        from litegen.experimental.master_adamw import one_pass_step
        from litegen.optim import set_master_step_kernel

        set_master_step_kernel(optimizer, one_pass_step)


__all__ = ["TESTED_TORCH", "Lab", "available", "torch_release"]
