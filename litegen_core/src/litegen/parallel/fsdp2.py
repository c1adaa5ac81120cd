"""FSDP2 (``fully_shard``) and HSDP: parameters, gradients and optimizer state sharded.

``fsdp2`` shards every planned unit (see ``parallel/wrap.py``), and every submodule of a unit
that the model calls from outside it (``parallel/outside_calls.py``), across all data-parallel
ranks of a 1-D mesh. ``hsdp`` is the same on a 2-D ``(replicate, shard)`` mesh: units are sharded
within a node and replicated across nodes. Parameters become DTensors with their original
names, so optimizers are rebound by name and full/DCP state dicts come from torch's
``torch.distributed.checkpoint.state_dict`` (``base.py``'s defaults).

On one rank there is nothing to shard and nothing to reduce, yet ``fully_shard`` would still copy
every unit's parameters into and out of its all-gather buffers at each forward and backward,
copy the gradients through its reduce-scatter, and run its hooks around every unit. So a world
of one trains the model unwrapped, as a single-GPU script would (said once in the log), when
nothing else depends on the wrap: no ``cpu_offload`` (which works through it) and no
``fsdp_mixed`` dtypes (which the wrap applies). The parameters, the FP32 masters, the EMA
(``Shard(0)`` over the one-rank mesh, as for ddp) and the state dicts keep the same names, so
checkpoints load at any world size and results are those of the wrapped model.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from litegen.parallel.base import Strategy, broadcast_from_rank0, rebind_optimizer
from litegen.parallel.mesh import dp_mesh, hsdp_mesh
from litegen.parallel.outside_calls import called_from_outside, guard_outside_calls
from litegen.parallel.plan import ParallelPlan
from litegen.parallel.wrap import in_post_order, last_unit, select_wrap_units
from litegen.precision.dtypes import fsdp2_mixed_policy

log = logging.getLogger("litegen")

# torch (2.13 and later) warns, once per rank over the progress bar, when a sharded unit
# returns a view: an in-place op on that view would drop the unit's pre-backward hook. The
# units are a model's blocks and the model itself, and diffusers' transformers return views by
# construction (unpatchify's reshape and permute; single-stream blocks' split of the joint
# text/image sequence) without ever changing them in place, so the warning says nothing about
# them. An in-place op on the model's output in train_step would: docs/strategies.md asks
# for out-of-place losses. Only this message is silenced, and only once fsdp2 or hsdp is used.
_VIEW_OUTPUT_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


class Fsdp2Strategy(Strategy):
    """``fully_shard`` on each planned unit, then on the root, over a 1-D data-parallel mesh.

    Example::

        strategy = Fsdp2Strategy(plan, config.optimization)
        model = strategy.wrap_model(model)  # model.blocks[0] is now an FSDPModule
    """

    # Whether a world of one trains unwrapped (module docstring); tests set it to False to
    # compare with the wrapped layout.
    unwrap_single_rank: bool = True

    def __init__(self, plan: ParallelPlan, optimization: Any) -> None:
        super().__init__(plan, optimization)
        # id(model) -> (model, its units); the model is kept so that its id stays its own.
        self._units: dict[int, tuple[nn.Module, list[str]]] = {}

    def mesh(self) -> DeviceMesh:
        return dp_mesh(self.plan)

    def planned_units(self, model: nn.Module) -> list[str]:
        """``select_wrap_units`` for ``model``, planned once: at :meth:`checkpoint_candidates`, before
        the memory savers and compile patch its blocks, and reused by :meth:`wrap_model`."""
        if id(model) not in self._units:
            self._units[id(model)] = (
                model,
                select_wrap_units(model, self.optimization.parallel.fsdp2),
            )
        return list(self._units[id(model)][1])

    def trains_unwrapped(self) -> bool:
        """One rank, and nothing but sharding would come from the wrap (module docstring)."""
        cfg = self.optimization.parallel.fsdp2
        mixed = self.optimization.precision.fsdp_mixed
        dtypes = (mixed.param_dtype, mixed.reduce_dtype, mixed.output_dtype)
        return (
            self.unwrap_single_rank
            and self.plan.world_size == 1
            and not cfg.cpu_offload
            and all(dtype is None for dtype in dtypes)
        )

    def wrap_model(self, model: nn.Module) -> nn.Module:
        cfg = self.optimization.parallel.fsdp2
        if self.trains_unwrapped():
            log.info("%s on one rank: training unwrapped (nothing to shard or reduce)", self.name)
            return model.to(self.plan.device)
        planned = self.planned_units(model)
        last = last_unit(model, planned)
        # Submodules the model calls from outside their unit get units of their own.
        outside = called_from_outside(model, planned, cfg.exclude_paths)
        if outside:
            log.info("%s: units of their own for %s (called from outside)", self.name, outside)
        units = in_post_order(model, planned + outside)
        model = model.to(self.plan.device)
        modules = dict(model.named_modules())
        guard_outside_calls(
            model, {path: modules[path] for path in units}, self.name, _wrap_paths_fix(units)
        )
        ignored = {p for path in cfg.exclude_paths for p in modules[path].parameters()}
        broadcast_from_rank0(model)
        common = {
            "mesh": self.mesh(),
            "mp_policy": fsdp2_mixed_policy(self.optimization.precision.fsdp_mixed),
            # Excluded (frozen) parameters stay plain, replicated tensors in no unit.
            "ignored_params": ignored or None,
            "offload_policy": self.offload_policy(),
        }

        def reshard(override: bool | int | None) -> bool | int | None:
            # None everywhere keeps torch's default (reshard units, keep the root gathered).
            return cfg.reshard_after_forward if override is None else override

        warnings.filterwarnings("ignore", message=_VIEW_OUTPUT_WARNING, category=UserWarning)
        for path in units:  # bottom-up: a unit is sharded before any unit around it
            override = cfg.last_unit_reshard_after_forward if path == last else None
            fully_shard(modules[path], reshard_after_forward=reshard(override), **common)
        fully_shard(model, reshard_after_forward=reshard(cfg.root_reshard_after_forward), **common)
        return model

    def offload_policy(self) -> OffloadPolicy:
        """``CPUOffloadPolicy`` when ``fsdp2.cpu_offload`` is set (pinned host memory on
        CUDA, where the copies overlap compute), else torch's no-offload default."""
        if not self.optimization.parallel.fsdp2.cpu_offload:
            return OffloadPolicy()
        return CPUOffloadPolicy(pin_memory=self.plan.device.type == "cuda")

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, fqn_of: dict[int, str]
    ) -> torch.optim.Optimizer:
        rebind_optimizer(optimizer, model, fqn_of)
        return super().wrap_optimizer(optimizer, model, fqn_of)

    def unwrap(self, model: nn.Module) -> nn.Module:
        # fully_shard changes the module's class in place; there is no wrapper to peel off.
        return model

    def reshard(self, model: nn.Module) -> None:
        # The root keeps its parameters gathered after a forward (reshard_after_forward's
        # default for it), as plain tensors in place of the DTensor shards; loading a state
        # into them would mix the two, and writing them would be undone by the next gather.
        for sub in model.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()

    def load_full_model_state(
        self, model: nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True
    ) -> None:
        self.reshard(model)
        super().load_full_model_state(model, state, strict=strict)

    def checkpoint_candidates(self, model: nn.Module) -> list[str]:
        """The planned sharding units, outermost callable ones, in forward order, so that a
        checkpointed region is one unit's forward (its all-gather runs outside the recompute)."""
        modules = dict(model.named_modules())
        # Containers (ModuleList/ModuleDict) are never called, so checkpointing them does nothing;
        # of nested units, the outer one saves more and contains the inner one's work.
        units = [
            u
            for u in self.planned_units(model)
            if not isinstance(modules[u], nn.ModuleList | nn.ModuleDict)
        ]
        outer = [u for u in units if not any(u.startswith(o + ".") for o in units)]
        order = {n: i for i, n in enumerate(modules)}
        return sorted(outer, key=order.__getitem__)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        if not isinstance(model, FSDPModule):  # one rank, unwrapped: gradients stay local
            return super().no_sync(model)
        return _no_gradient_sync(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            # DTensor's norm already reduced the shards' partial norms (a replicated DTensor);
            # full_tensor() makes it the plain tensor that callers log and clip with.
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
        return norm


def _wrap_paths_fix(units: list[str]) -> Callable[[str], str]:
    """How to make a submodule that the model calls from outside its unit a unit of its own."""

    def fix(path: str) -> str:
        return (
            f"Make it a unit of its own: set optimization.parallel.fsdp2.wrap_strategy: manual "
            f"and wrap_paths: {[path, *units]}."
        )

    return fix


class HsdpStrategy(Fsdp2Strategy):
    """FSDP2 on a ``(replicate=nnodes, shard=local_world_size)`` mesh.

    Example::

        HsdpStrategy(plan, config.optimization).mesh().mesh_dim_names
    """

    def mesh(self) -> DeviceMesh:
        return hsdp_mesh(self.plan)


@contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the final micro-batch reduces them all."""
    model.set_requires_gradient_sync(False)  # recurses into every unit (and HSDP's all-reduce)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
