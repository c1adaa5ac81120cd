"""The one interface every parallel strategy implements, and the shared default behaviour.

``prepare`` talks to strategies only through this class. The defaults suit strategies whose
wrapped model keeps the user's parameters (DDP); sharding strategies override what differs.
Full state dicts go through ``torch.distributed.checkpoint.state_dict``, which already
understands DDP, FSDP1 and FSDP2 modules.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from litegen.checkpoint.files import save_state
from litegen.config.strategies import requirement_problems, strategy_row
from litegen.model_parts.blocks import repeated_blocks
from litegen.model_parts.paths import clean_name
from litegen.parallel.plan import ParallelPlan

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
# On a CPU job there is nothing to offload, and FSDP1's offload path frees the tensors it hands
# out when the parameters already live on the CPU (torch 2.13): gather in place instead.
FULL_STATE_ON_CPU = StateDictOptions(full_state_dict=True)


def broadcast_from_rank0(model: nn.Module) -> None:
    """Start every rank from rank 0's weights, as DDP does when it wraps a model."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, fqn_of: dict[int, str]
) -> torch.optim.Optimizer:
    """Point ``optimizer``'s groups at ``model``'s current parameters, matched by name, in place.

    The groups (their order, membership and hyperparameters) and the optimizer object are
    kept, so an LR scheduler built on the optimizer before ``prepare`` keeps working.

    Example::

        fqn_of = {id(p): n for n, p in model.named_parameters()}  # before wrapping
        rebind_optimizer(optimizer, sharded_model, fqn_of) is optimizer
    """
    if optimizer.state:
        raise ValueError(
            "the optimizer already has state (it has stepped), which cannot follow the "
            "parameters into their sharded form; pass it to prepare before the first step and "
            "load saved optimizer state after prepare (resume_from or gen.load_model_state)."
        )
    current = {clean_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            name = fqn_of.get(id(param))
            if name is None or name not in current:
                raise ValueError(
                    f"an optimizer parameter ({'unnamed' if name is None else name!r}) is not "
                    "a parameter of the model it was prepared with; build the optimizer on "
                    "model.parameters() of that model."
                )
            rebound.append(current[name])
        group["params"] = rebound
    return optimizer


class Strategy:
    """How one trainable model and its optimizer are spread over the data-parallel ranks.

    Example::

        strategy = build_strategy(plan, optimization_cfg)
        model = strategy.wrap_model(model)
        optimizer = strategy.wrap_optimizer(optimizer, model)
    """

    def __init__(self, plan: ParallelPlan, optimization: Any) -> None:
        self.plan = plan
        self.optimization = optimization
        self.name = plan.strategy
        # The strategy's facts (litegen.config.strategies.TABLE); its option rules hold here.
        self.row = strategy_row(plan.strategy)
        problems = requirement_problems(optimization, plan.strategy)
        if problems:
            raise ValueError(f"{problems[0]}.")

    @property
    def ema_from_copy(self) -> bool:
        """The EMA is an FP32 copy of the model wrapped like it (see :meth:`build_ema`)."""
        return self.row.ema == "wrapped copy"

    @property
    def master_weights(self) -> bool:
        """The strategy applies ``optimization.optimizer.fp32_master_weights``; the others
        ignore it with a warning (configure_optimizer's, which names the strategies that do)."""
        return self.row.master_weights

    @property
    def shards_parameters(self) -> bool:
        """Each rank holds only a shard of the parameters, so a forward is collective."""
        return self.row.shards_parameters

    # -- wrapping ---------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move a trainable model to the device and wrap it for this strategy."""
        raise NotImplementedError

    def wrap_frozen_model(self, model: nn.Module) -> nn.Module:
        """Frozen models (text encoders, VAEs) are replicated, in eval mode, without grads."""
        return model.to(self.plan.device).eval().requires_grad_(False)

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, fqn_of: dict[int, str]
    ) -> torch.optim.Optimizer:
        """Return the optimizer that steps ``model``'s (possibly new) parameters.

        ``fqn_of`` maps ``id(parameter)`` of the parameters the optimizer was built on to their
        names, captured before wrapping. Strategies that replace parameters rebind the
        optimizer's groups in place, so LR schedulers built on it stay valid. The default keeps
        the parameters and applies ``optimization.optimizer`` (master weights only where
        ``master_weights`` is set).
        """
        from litegen.optim import configure_optimizer

        return configure_optimizer(
            optimizer,
            self.optimization.optimizer,
            master_weights=self.master_weights,
            strategy=f"strategy {self.name}",
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper this strategy added."""
        return model

    def reshard(self, model: nn.Module) -> None:
        """Bring ``model`` back to its at-rest layout (the one state dicts read and write).

        A no-op, except where a forward leaves gathered parameters in place (fsdp1, fsdp2,
        hsdp)."""

    def checkpoint_candidates(self, model: nn.Module) -> list[str]:
        """The modules activation checkpointing chooses from: the model's repeated blocks."""
        return repeated_blocks(model)

    # -- training step ----------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Context for micro-batches that only accumulate gradients (no communication)."""
        return nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    # -- full (unsharded) state, for single-file checkpoints ---------------------------------
    def full_model_state(
        self, model: nn.Module, *, trainable_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """The whole model on CPU, keyed like the user's module; call on every rank.

        ``trainable_only`` leaves out frozen parameters without gathering them (LoRA adapters).
        """
        options = replace(self._full_options(), ignore_frozen_params=trainable_only)
        return get_model_state_dict(model, options=options)

    def load_full_model_state(
        self, model: nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True
    ) -> None:
        """Load a whole-model state (every rank passes the same dict); ``strict=False`` loads
        the keys ``state`` has and leaves the others (LoRA adapters into an adapted model)."""
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(model, state, options=options)

    def full_optimizer_state(self, optimizer, model: nn.Module) -> dict[str, Any]:
        """The optimizer state keyed by parameter names, whole, on CPU; call on every rank."""
        return get_optimizer_state_dict(model, optimizer, options=self._full_options())

    def _full_options(self) -> StateDictOptions:
        return FULL_STATE_ON_CPU if self.plan.device.type == "cpu" else FULL_STATE

    def load_full_optimizer_state(self, optimizer, model: nn.Module, state: dict) -> None:
        set_optimizer_state_dict(
            model, optimizer, state, options=StateDictOptions(full_state_dict=True)
        )

    # -- EMA ----------------------------------------------------------------------------------
    def build_ema(self, model: nn.Module, optimizer=None, *, sharded: bool = True, template=None):
        """The EMA of ``model``: FP32 shards in this strategy's layout (see ``litegen.ema``).

        Replicated parameters are split on dim 0 over the data-parallel mesh; DTensor
        parameters keep their own mesh and placements. For ``ema_from_copy`` strategies,
        ``template`` is an unwrapped copy of the model taken before wrapping, and the EMA is
        that copy in FP32, wrapped by this strategy.
        """
        from litegen.ema import EMA, WrappedCopyEMA
        from litegen.parallel.mesh import dp_mesh

        if self.ema_from_copy:
            assert template is not None, "prepare keeps a template for ema_from_copy strategies"
            return WrappedCopyEMA(model, self.wrap_model(template.float()), self)

        mesh = dp_mesh(self.plan) if sharded else None
        return EMA(self.unwrap(model), mesh=mesh, optimizer=optimizer, sharded=sharded)

    # -- optimizer files (save_optimizer / resume_from) ---------------------------------------
    def save_optimizer_file(
        self, optimizer, model: nn.Module, path: Path, state_format: str
    ) -> Path:
        """Write the optimizer state to ``path``; call on every rank.

        The default gathers the full state and rank 0 writes one file. Sharding strategies may
        write rank-local shards plus a manifest for ``state_format="auto"`` (see zero1).
        """
        state = self.full_optimizer_state(optimizer, model)
        if self.plan.rank == 0:
            save_state(state, path)
        dist.barrier()
        return path

    def load_optimizer_file(self, optimizer, model: nn.Module, path: Path) -> None:
        """Load what :meth:`save_optimizer_file` (of any strategy) wrote: one full file, or a
        ZeRO manifest with its rank shards (saved at any world size)."""
        from litegen.checkpoint.zero_state import load_optimizer_state

        self.load_full_optimizer_state(optimizer, model, load_optimizer_state(path))

    # -- sharded state for torch.distributed.checkpoint (reshards on load) -------------------
    def dcp_state(self, model: nn.Module, optimizer=None) -> dict[str, Any]:
        """Model (and optimizer) state as DCP expects it: sharded where the strategy shards.
        A model with LoRA adapters keeps only what trains (its frozen base is the pipeline's)."""
        options = dcp_options(model)
        if optimizer is None:
            return {"model": get_model_state_dict(model, options=options)}
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        return {"model": model_state, "optimizer": optim_state}

    def load_dcp_state(self, model: nn.Module, optimizer, state: dict[str, Any]) -> None:
        """Apply a state dict that ``dcp.load`` filled in place of :meth:`dcp_state`'s."""
        options = dcp_options(model)
        if optimizer is None:
            set_model_state_dict(model, state["model"], options=options)
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )


def dcp_options(model: nn.Module) -> StateDictOptions:
    """How a run checkpoint holds ``model``: all of it, or, when it trains LoRA adapters, the
    trainable parameters alone. The frozen base comes from the pipeline on every start, so a
    14B base is not written again at every checkpoint; ``strict=False`` lets the load leave
    it in place (``dcp.load`` still refuses a checkpoint that lacks an adapter).

    Example::

        dcp.save({"model": get_model_state_dict(model, options=dcp_options(model))}, ...)
    """
    from litegen.lora import has_adapters

    if not has_adapters(model):
        return StateDictOptions()
    return StateDictOptions(ignore_frozen_params=True, strict=False)
