"""FSDP1: ``FullyShardedDataParallel`` around each repeated block and around the root.

Each detected block (``litegen.model_parts.blocks.repeated_blocks``) becomes one flat-parameter unit, and so
does each submodule of a block that the model calls from outside it (``parallel.outside_calls``);
the root unit owns the rest (embeddings, final layers). ``use_orig_params=True`` keeps the user's
parameter objects and names visible, so optimizers rebind by name, LR schedulers keep working,
and torch's state-dict API returns clean names (no ``_fsdp_wrapped_module``).

Mixed precision (documented in docs/strategies.md) reuses ``optimization.precision.fsdp_mixed``:

=====================  ========================================================
fsdp_mixed field       FSDP1 ``MixedPrecision`` field
=====================  ========================================================
param_dtype            param_dtype (all-gather and compute dtype)
reduce_dtype           reduce_dtype (gradient reduce-scatter dtype)
cast_forward_inputs    cast_forward_inputs and cast_root_forward_inputs
output_dtype           no FSDP1 equivalent: setting it is an error
=====================  ========================================================

``cast_model`` is applied by ``prepare`` before wrapping, so FSDP1 simply shards the cast
parameters; buffers are never cast by the policy (as in FSDP2).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
from torch.distributed.fsdp.wrap import CustomPolicy

from litegen.model_parts.blocks import repeated_blocks
from litegen.parallel.base import Strategy, broadcast_from_rank0, rebind_optimizer
from litegen.parallel.outside_calls import called_from_outside, guard_outside_calls
from litegen.precision.dtypes import DTYPES

log = logging.getLogger("litegen")


def fsdp1_mixed_precision(cfg: Any) -> MixedPrecision | None:
    """``optimization.precision.fsdp_mixed`` mapped onto FSDP1; None when nothing is asked.

    Example:
        >>> from litegen.config.sections import FSDPMixedConfig
        >>> fsdp1_mixed_precision(FSDPMixedConfig(param_dtype="bf16")).param_dtype
        torch.bfloat16
    """
    # The strategy table refuses output_dtype under fsdp1 before anything is wrapped.
    assert cfg.output_dtype is None, "Strategy.__init__ checks the row's requirements"
    if cfg.param_dtype is None and cfg.reduce_dtype is None:
        return None
    return MixedPrecision(
        param_dtype=DTYPES[cfg.param_dtype] if cfg.param_dtype else None,
        reduce_dtype=DTYPES[cfg.reduce_dtype] if cfg.reduce_dtype else None,
        cast_forward_inputs=cfg.cast_forward_inputs,
        cast_root_forward_inputs=cfg.cast_forward_inputs,
    )


def _fsdp1_fix(path: str) -> str:
    return (
        f"Return {path} from the model's get_fsdp_wrap_module_list() next to its blocks (each "
        "listed module is a unit), or use strategy fsdp2 and list it in "
        "optimization.parallel.fsdp2.wrap_paths."
    )


class Fsdp1Strategy(Strategy):
    """``FullyShardedDataParallel`` with one unit per repeated block, ``use_orig_params=True``.

    Example::

        model = Fsdp1Strategy(plan, config.optimization).wrap_model(model)
        type(model).__name__
    """

    def wrap_model(self, model: nn.Module) -> nn.Module:
        modules = dict(model.named_modules())
        blocks = repeated_blocks(model)
        if not blocks:
            log.warning(
                "%s: %s has no repeated blocks, so the whole model is one FSDP unit (every "
                "rank gathers all parameters at once); implement get_fsdp_wrap_module_list() "
                "to choose units.",
                self.name,
                type(model).__name__,
            )
        # Submodules the model calls from outside their block get units of their own.
        outside = called_from_outside(model, blocks)
        if outside:
            log.info("%s: units of their own for %s (called from outside)", self.name, outside)
        units = {path: modules[path] for path in blocks + outside}
        guard_outside_calls(model, units, self.name, _fsdp1_fix)
        unit_ids = {id(module) for module in units.values()}
        model = model.to(self.plan.device)
        # Every rank starts from rank 0's weights, as with DDP. (FSDP1's own
        # sync_module_states refuses CPU modules, so the broadcast happens here.)
        broadcast_from_rank0(model)
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=CustomPolicy(lambda module: id(module) in unit_ids),
            mixed_precision=fsdp1_mixed_precision(self.optimization.precision.fsdp_mixed),
            use_orig_params=True,
            # Given explicitly: without it FSDP1 looks for an accelerator and refuses CPU.
            device_id=self.plan.device,
        )

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, fqn_of: dict[int, str]
    ) -> torch.optim.Optimizer:
        # use_orig_params keeps the parameter objects; rebinding by name makes that explicit
        # and still works if a torch version swaps them. Then whatever the base applies.
        rebind_optimizer(optimizer, model, fqn_of)
        return super().wrap_optimizer(optimizer, model, fqn_of)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, FullyShardedDataParallel) else model

    def reshard(self, model: nn.Module) -> None:
        # FSDP1 keeps the root unit's gathered parameters after a forward, for the backward it
        # expects next. After a no-grad forward (a sample or validation hook) no backward frees
        # them, and the next forward reuses that gathered copy instead of gathering the shards
        # again: stale once the shards change, as when ema_weights swaps the EMA in and out.
        # torch has no public call for this; _reshard is what FSDP1's own backward calls.
        from torch.distributed.fsdp._runtime_utils import _reshard

        for state in FullyShardedDataParallel.fsdp_modules(model):
            handle = state._handle
            if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
                _reshard(state, handle, free_unsharded_flat_param=True)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return model.no_sync()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # The root FSDP unit reduces the partial norms of every rank's shards.
        return model.clip_grad_norm_(max_norm)
