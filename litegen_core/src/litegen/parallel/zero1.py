"""ZeRO-1: parameters replicated, optimizer state partitioned over the data-parallel ranks.

Gradients are averaged in flat buckets of ``bucket_size_mb`` (see :mod:`buckets`); every rank
then steps only its partition and the parameters are synchronised again. The partition depends
on ``parameter_sync``:

* ``bucketed`` (default, ours): every bucket is padded to a multiple of the data-parallel size
  and rank ``r`` owns the ``r``-th contiguous slice of it, parameter boundaries ignored. The
  user's optimizer keeps its object and its param-group dicts, but each group's ``params`` is
  rebound in place to that group's partition tensors, and the updated partitions are
  all-gathered back into the parameters. The optimizer must update element by element
  (Adam/AdamW/SGD and the like); optimizers that look at whole tensors need ``native``.
* ``native`` / ``native_bucket_view``: ``torch.distributed.optim.ZeroRedundancyOptimizer``
  assigns whole parameters to ranks and broadcasts them after the step (``_bucket_view``:
  ``parameters_as_bucket_view=True``). It is returned *instead of* the user's optimizer, but its
  ``param_groups`` is the user's optimizer's own list, so an LR scheduler built on the user's
  optimizer still takes effect.

Other options: ``overlap_comm`` launches a bucket's reduction from post-accumulate-grad hooks
during the last backward of an accumulation window; ``release_grad_buffer`` frees the flat
gradient buffers after each step instead of keeping them for the next one;
``normalize_parameter_layout`` moves each bucket's parameters into one contiguous buffer so the
partition is a view of the parameters and the gather writes into them without a copy.

Example::

    strategy = Zero1Strategy(plan, config.optimization)
    model = strategy.wrap_model(model)
    optimizer = strategy.wrap_optimizer(optimizer, model, fqns_of(model))
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _init_optim_state,
    get_model_state_dict,
    set_model_state_dict,
)

from litegen.checkpoint import zero_state
from litegen.optim import apply_backend, configure_optimizer, enable_master_weights
from litegen.parallel.base import Strategy, broadcast_from_rank0, dcp_options
from litegen.parallel.grad_buckets import (
    BucketedGradients,
    build_buckets,
    gather_params,
    refresh_shards,
)

BYTES_PER_MB = 1 << 20  # a module constant so tests can make buckets smaller than 1 MB

# Optimizers whose update is element-wise, so stepping a flat slice equals stepping the tensors.
_ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
)


class _Partition:
    """One optimizer's ZeRO machinery: gradient buckets, partition, step hooks, state pieces."""

    def __init__(self, strategy: Zero1Strategy, optimizer, fqn_of: dict[int, str]) -> None:
        settings = strategy.optimization.parallel.zero
        plan = strategy.plan
        self.optimizer = optimizer
        self.native = settings.parameter_sync != "bucketed"
        self.group_params = [list(g["params"]) for g in optimizer.param_groups]
        self.fqn = {id(p): fqn_of[id(p)] for ps in self.group_params for p in ps}
        self.shapes = {self.fqn[id(p)]: list(p.shape) for ps in self.group_params for p in ps}
        self.buckets = build_buckets(
            self.group_params,
            bucket_bytes=settings.bucket_size_mb * BYTES_PER_MB,
            # Over every rank, sequence-parallel ones included (see parallel/mesh.py).
            dp_size=plan.world_size,
            dp_rank=plan.rank,
            shard=not self.native,
            flatten=settings.normalize_parameter_layout,
        )
        self.grads = BucketedGradients(
            self.buckets,
            mode=strategy.grad_mode,
            overlap=settings.overlap_comm,
            release=settings.release_grad_buffer,
        )
        previous = strategy.full_state_of(optimizer, self.fqn) if optimizer.state else None
        opt_settings = strategy.optimization.optimizer
        if self.native:
            apply_backend(optimizer, opt_settings)  # ZeRO copies the user's group flags
            self.stepper = self._native_optimizer(optimizer, settings.parameter_sync)
            self.local = self.stepper.optim
            if opt_settings.fp32_master_weights:
                enable_master_weights(self.local)
        else:
            self.stepper = self.local = optimizer
            self.local.state.clear()
            for index, group in enumerate(optimizer.param_groups):
                group["params"] = [b.shard for b in self.buckets if b.group == index]
        # Our pre-hook first (it provides the gradients the master step reads), our post-hook
        # last (it clears gradients after the master-weight hook restored them).
        self.stepper.register_step_pre_hook(lambda *_: self.before_step())
        if not self.native:
            configure_optimizer(optimizer, opt_settings, master_weights=strategy.master_weights)
        self.stepper.register_step_post_hook(lambda *_: self.after_step())
        self._patch_zero_grad(self.stepper)
        if previous is not None:
            self.load_full(previous)

    def _native_optimizer(self, optimizer, mode: str):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        zero = ZeroRedundancyOptimizer(
            [dict(g) for g in optimizer.param_groups],
            optimizer_class=cls,
            parameters_as_bucket_view=mode == "native_bucket_view",
            **defaults,
        )
        # Share the user's group dicts: a scheduler stepping the user's optimizer changes the
        # lr that ZeRO copies into its local optimizer at every step.
        zero.param_groups = optimizer.param_groups
        return zero

    def _patch_zero_grad(self, optimizer) -> None:
        original = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            original(set_to_none=set_to_none)
            self.grads.discard()  # a skipped step must not leak reductions into the next

        optimizer.zero_grad = zero_grad

    # -- step ----------------------------------------------------------------------------------
    def before_step(self) -> None:
        self.grads.finish()
        if not self.native:
            refresh_shards(self.buckets)

    def after_step(self) -> None:
        if not self.native:  # ZeroRedundancyOptimizer broadcasts its own parameters
            gather_params(self.buckets)
        self.grads.clear()

    def grad_norm_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm."""
        self.grads.finish()
        if self.native:  # whole averaged gradients everywhere: count owned parameters only
            owned = [p for g in self.local.param_groups for p in g["params"] if p.grad is not None]
            return sum((p.grad.float().pow(2).sum() for p in owned), torch.zeros(()))
        return self.grads.shard_grad_norm_sq()

    def scale_grads(self, factor: torch.Tensor) -> None:
        for bucket in self.buckets:
            if bucket.reduced is not None:
                bucket.reduced.mul_(factor.to(bucket.reduced.dtype))

    # -- state ---------------------------------------------------------------------------------
    def local_pieces(self) -> list[zero_state.Piece]:
        pieces = []
        if self.native:
            for group in self.local.param_groups:
                for p in group["params"]:
                    if p in self.local.state:
                        flat, scalar = zero_state.split_state(self.local.state[p], p.numel())
                        pieces.append(
                            zero_state.make_piece(self.fqn[id(p)], 0, p.numel(), flat, scalar)
                        )
            return pieces
        for bucket in self.buckets:
            state = self.local.state.get(bucket.shard)
            if not state:
                continue
            flat, scalar = zero_state.split_state(state, bucket.shard_numel)
            for p, p_off, s_off, n in bucket.pieces(bucket.shard_start, bucket.shard_numel):
                sliced = {k: v[s_off : s_off + n] for k, v in flat.items()}
                pieces.append(zero_state.make_piece(self.fqn[id(p)], p_off, n, sliced, scalar))
        return pieces

    def groups(self) -> list[dict]:
        names = [[self.fqn[id(p)] for p in ps] for ps in self.group_params]
        return [
            zero_state.hyperparameters(g, n)
            for g, n in zip(self.optimizer.param_groups, names, strict=True)
        ]

    def load_full(self, full: dict[str, Any]) -> None:
        """Keep this rank's part of a full state (keyed by FQN) in the local optimizer."""
        zero_state.load_hyperparameters(self.optimizer.param_groups, full["param_groups"])
        states = full["state"]
        if self.native:
            for group in self.local.param_groups:
                for p in group["params"]:
                    state = states.get(self.fqn[id(p)])
                    if state is not None:
                        self.local.state[p] = _to_device(state, p.device)
            self.stepper._sync_param_groups(self.stepper.param_groups, self.local.param_groups)
            return
        self.local.state.clear()
        for bucket in self.buckets:
            known = [
                (p, states[self.fqn[id(p)]]) for p in bucket.params if self.fqn[id(p)] in states
            ]
            if not known:
                continue
            state = {}
            for key, value in known[0][1].items():
                if not (
                    torch.is_tensor(value)
                    and value.dim() > 0
                    and value.numel() == known[0][0].numel()
                ):
                    state[key] = value.clone() if torch.is_tensor(value) else value
                    continue
                shard = torch.zeros(bucket.shard_numel, dtype=value.dtype, device=bucket.device)
                values = {p: s[key] for p, s in known if key in s}
                bucket.read_params(shard, bucket.shard_start, bucket.shard_numel, values.get)
                state[key] = shard
            self.local.state[bucket.shard] = state


def _to_device(state: dict, device: torch.device) -> dict:
    # 0-dim values such as Adam's "step" stay on the CPU, as torch's optimizers keep them.
    return {
        k: v.to(device).clone() if torch.is_tensor(v) and v.dim() > 0 else v
        for k, v in state.items()
    }


class Zero1Strategy(Strategy):
    """Our bucketed ZeRO-1 (or ZeroRedundancyOptimizer, by ``parameter_sync``); see the module."""

    grad_mode: ClassVar[str] = "all_reduce"

    def __init__(self, plan, optimization) -> None:
        super().__init__(plan, optimization)
        self._partitions: dict[int, list[_Partition]] = {}  # id(model) -> its optimizers

    # -- wrapping --------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.plan.device)
        broadcast_from_rank0(model)  # replicated parameters
        self._partitions[id(model)] = []
        return model

    def wrap_optimizer(self, optimizer, model: nn.Module, fqn_of: dict[int, str]):
        """Partition ``optimizer`` over the ranks; see the module docs for what comes back."""
        sync = self.optimization.parallel.zero.parameter_sync
        if sync == "bucketed" and not isinstance(optimizer, _ELEMENTWISE):
            raise ValueError(
                f"{self.name} with parameter_sync 'bucketed' splits tensors across ranks, which "
                f"needs an element-wise optimizer (SGD, Adam, AdamW, ...), not "
                f"{type(optimizer).__name__}; set optimization.parallel.zero.parameter_sync: "
                "native."
            )
        partition = _Partition(self, optimizer, fqn_of)
        self._partitions.setdefault(id(model), []).append(partition)
        return partition.stepper

    def build_ema(self, model: nn.Module, optimizer=None, *, sharded: bool = True, template=None):
        """Average the partitions this rank steps (bucketed sync); else the generic EMA."""
        parts = self._partitions.get(id(model), [])
        if not sharded or len(parts) != 1 or parts[0].native:
            return super().build_ema(model, optimizer, sharded=sharded, template=template)
        from litegen.parallel.zero_ema import BucketEMA

        return BucketEMA(model, parts[0].buckets, parts[0].local)

    def _of(self, model: nn.Module, optimizer=None) -> list[_Partition]:
        parts = self._partitions.get(id(model), [])
        if optimizer is not None:
            parts = [p for p in parts if optimizer in (p.stepper, p.optimizer)]
        if not parts:
            raise ValueError(f"this model/optimizer was not prepared by the {self.name} strategy.")
        return parts

    # -- training step ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        parts = self._partitions.get(id(model), [])
        for part in parts:
            part.grads.sync = False
        try:
            yield
        finally:
            for part in parts:
                part.grads.sync = True

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global norm over all partitions (each rank sums squares of what it owns)."""
        parts = self._of(model)
        total_sq = sum(
            (p.grad_norm_sq().to(self.plan.device) for p in parts),
            torch.zeros((), device=self.plan.device),
        )
        dist.all_reduce(total_sq)
        norm = total_sq.sqrt()
        # Same formula as torch.nn.utils.clip_grad_norm_, so results match DDP's.
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for part in parts:
            part.scale_grads(factor)
        return norm

    # -- optimizer state -------------------------------------------------------------------------
    def full_state_of(self, optimizer, fqn: dict[int, str]) -> dict[str, Any]:
        """An unwrapped optimizer's state keyed by FQN (used when it stepped before prepare)."""
        state = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p in optimizer.state:
                    state[fqn[id(p)]] = dict(optimizer.state[p])
        groups = [
            zero_state.hyperparameters(g, [fqn[id(p)] for p in g["params"]])
            for g in optimizer.param_groups
        ]
        return zero_state.full_state(state, groups)

    def full_optimizer_state(self, optimizer, model: nn.Module) -> dict[str, Any]:
        part = self._of(model, optimizer)[0]
        gathered: list[list] = [None] * self.plan.world_size
        dist.all_gather_object(gathered, part.local_pieces())
        state = zero_state.full_from_pieces((p for ps in gathered for p in ps), part.shapes)
        return zero_state.full_state(state, part.groups())

    def load_full_optimizer_state(self, optimizer, model: nn.Module, state: dict) -> None:
        self._of(model, optimizer)[0].load_full(state)

    def save_optimizer_file(
        self, optimizer, model: nn.Module, path: Path, state_format: str
    ) -> Path:
        """``"auto"``: one shard of pieces per rank plus a JSON manifest at ``path``."""
        if state_format == "full":
            return super().save_optimizer_file(optimizer, model, path, state_format)
        part = self._of(model, optimizer)[0]
        return zero_state.save_sharded(
            Path(path),
            part.local_pieces(),
            shapes=part.shapes,
            groups=part.groups(),
            strategy=self.name,
        )

    # -- torch.distributed.checkpoint ------------------------------------------------------------
    def dcp_state(self, model: nn.Module, optimizer=None) -> dict[str, Any]:
        """Model and the full optimizer state per FQN (replicated, so DCP writes it once)."""
        state = {"model": get_model_state_dict(model, options=dcp_options(model))}
        if optimizer is not None:
            # DCP loads into the tensors it is given, so they must exist before a first step.
            _init_optim_state(optimizer)
            state["optimizer"] = self.full_optimizer_state(optimizer, model)
        return state

    def load_dcp_state(self, model: nn.Module, optimizer, state: dict[str, Any]) -> None:
        set_model_state_dict(model, state["model"], options=dcp_options(model))
        if optimizer is not None:
            self.load_full_optimizer_state(optimizer, model, state["optimizer"])


__all__ = ["Zero1Strategy"]
