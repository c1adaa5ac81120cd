"""Sharded exponential moving average (EMA) of a trainable model's weights.

Every EMA tensor is an FP32 shard laid out as a DTensor:

- FSDP2 / HSDP parameters already are DTensors; the EMA keeps an FP32 copy of the local shard,
  with the same mesh and placements.
- Replicated parameters (ddp, zero1, zero2) are split on dim 0 over the data-parallel ranks
  (``Shard(0)``, the layout FSDP2 uses), so each rank keeps about 1/dp of the average.
- With ``ema.sharded: false`` the EMA is a full FP32 replica on every rank.

Only trainable parameters (``requires_grad``) are averaged: a frozen one is its own average,
so LoRA runs keep an EMA of the adapters alone. ``state_dict`` holds what is averaged and the
buffers; ``LiteGen.full_ema_state`` adds the frozen parameters from the model.

Updates are one fused ``lerp`` over local tensors, without communication. When the optimizer
keeps FP32 master weights (``state[p]["master"]``), the EMA follows them rather than the
low-precision parameters. Gathering (``state_dict``) and DCP resharding come from DTensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


@dataclass
class _Slot:
    """One parameter's EMA: the FP32 local shard and where that shard sits globally."""

    name: str
    param: nn.Parameter
    local: Callable[[torch.Tensor], torch.Tensor]  # parameter or master -> this rank's piece
    ema: torch.Tensor
    mesh: DeviceMesh | None  # None: a full replica
    placements: tuple
    # The view the update reads, and the master tensor it was taken from (None: the
    # parameter). Parameters and masters are updated in place, so the view stays valid until
    # the optimizer hands out a new master (first step, or loading a state).
    source: torch.Tensor | None = None
    source_of: torch.Tensor | None = None

    def as_dtensor(self) -> torch.Tensor:
        if self.mesh is None:
            return self.ema
        return DTensor.from_local(
            self.ema,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.param.shape,
            stride=self.param.stride(),
        )


def _dim0_piece(rank: int, world: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rows of a full tensor that ``Shard(0)`` gives ``rank`` (``torch.chunk`` sizes)."""

    def piece(full: torch.Tensor) -> torch.Tensor:
        if full.dim() == 0:
            return full.reshape(1)[: 1 if rank == 0 else 0]
        chunks = torch.chunk(full, world, dim=0)
        return chunks[rank] if rank < len(chunks) else full[full.shape[0] :]

    return piece


def _to_local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers a state dict holds; non-persistent ones (RoPE tables) are
    rebuilt by the model itself.

    Example:
        >>> dict(persistent_buffers(nn.BatchNorm1d(4))).keys()
        dict_keys(['running_mean', 'running_var', 'num_batches_tracked'])
    """
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


class BufferMirror:
    """Copies of a model's persistent buffers, refreshed at every EMA update (buffers are not
    averaged).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> mirror = BufferMirror(model)
        >>> _ = model(torch.ones(8, 4))  # a training step moves the running statistics
        >>> mirror.refresh()
        >>> torch.equal(mirror.copies["1.running_mean"], model[1].running_mean)
        True
    """

    def __init__(self, model: nn.Module) -> None:
        named = list(persistent_buffers(model))
        self.copies = {name: b.detach().clone() for name, b in named}
        # Resolved once: walking the module tree at every update costs more than the copies.
        self._pairs = [(self.copies[name], b) for name, b in named]

    @torch.no_grad()
    def refresh(self) -> None:
        for mine, theirs in self._pairs:
            mine.copy_(theirs)

    def cpu_state(self) -> dict[str, torch.Tensor]:
        """The copies on CPU, keyed like the model's buffers."""
        return {name: b.cpu() for name, b in self.copies.items()}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Copy the buffers ``state`` has (a saved EMA state) into the copies."""
        for name, buffer in self.copies.items():
            if name in state:
                buffer.copy_(state[name])


class EMA:
    """An FP32 moving average of ``model``'s parameters, sharded like the strategy's layout.

    Example::

        ema = EMA(model, mesh=dp_mesh(plan), optimizer=optimizer)  # ema.sharded: true
        ema.update(decay=0.999)
        full = ema.state_dict()  # collective: every rank calls it
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mesh: DeviceMesh | None,
        optimizer: torch.optim.Optimizer | None = None,
        sharded: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.slots: list[_Slot] = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            if not sharded:
                # A full replica; a sharded parameter is gathered at every update.
                local, slot_mesh, placements = _full, None, ()
            elif isinstance(param, DTensor):
                local, slot_mesh, placements = _to_local, param.device_mesh, param.placements
            elif mesh is not None and param.dim() > 0:
                rank, world = mesh.get_local_rank(), mesh.size()
                local, slot_mesh, placements = _dim0_piece(rank, world), mesh, (Shard(0),)
            else:
                local, slot_mesh, placements = (lambda t: t), None, ()
            ema = local(param.detach()).float().clone()
            self.slots.append(_Slot(name, param, local, ema, slot_mesh, placements))
        self.mirror = BufferMirror(model)

    def _source(self, slot: _Slot) -> torch.Tensor:
        """The current value of the slot's piece: the FP32 master when the optimizer has one."""
        state = self.optimizer.state.get(slot.param) if self.optimizer is not None else None
        master = state.get("master") if state else None
        if slot.source is not None and master is slot.source_of and slot.mesh is not None:
            return slot.source  # unchanged since last time (DTensor views cost microseconds)
        if master is not None and master.shape == slot.param.shape:
            view = slot.local(master.detach())
        elif master is not None and master.shape == slot.ema.shape:
            view = _to_local(master.detach())
        else:
            view = slot.local(slot.param.detach())
        slot.source, slot.source_of = view, master
        return view

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """``ema = decay * ema + (1 - decay) * weights`` over all local shards at once."""
        sources = [self._source(s).float() for s in self.slots]
        torch._foreach_lerp_([s.ema for s in self.slots], sources, 1.0 - decay)
        self.mirror.refresh()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole average and the buffers on CPU, keyed like the model. Collective for
        sharded slots."""
        state = {}
        for slot in self.slots:
            state[slot.name] = _full(slot.as_dtensor()).detach().cpu()
        state.update(self.mirror.cpu_state())
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full average (every rank passes the same dict); each rank keeps its piece."""
        missing = [s.name for s in self.slots if s.name not in state]
        if missing:
            raise ValueError(
                f"EMA state lacks parameters {missing[:5]}; was it saved from this model?"
            )
        for slot in self.slots:
            full = state[slot.name].to(slot.ema.device, torch.float32)
            if slot.mesh is None:
                slot.ema.copy_(full)
            elif isinstance(slot.param, DTensor):
                piece = distribute_tensor(full, slot.mesh, slot.placements).to_local()
                slot.ema.copy_(piece)
            else:
                slot.ema.copy_(slot.local(full))
        self.mirror.load(state)

    def dcp_state(self) -> dict[str, torch.Tensor]:
        """DTensors over the local shards, which ``dcp.save``/``dcp.load`` reshard in place."""
        state = {slot.name: slot.as_dtensor() for slot in self.slots}
        state.update(self.mirror.copies)
        return state

    def load_dcp_state(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to copy: ``dcp.load`` wrote into the local shards behind :meth:`dcp_state`."""

    def local_bytes(self) -> int:
        """Bytes of EMA parameter state this rank holds."""
        return sum(s.ema.numel() * s.ema.element_size() for s in self.slots)


class WrappedCopyEMA:
    """The EMA as an FP32 copy of the model, wrapped by the same strategy (fsdp1).

    Both wrappers shard identically, so each rank averages its local shard pieces
    element-wise (the trainable ones); gathering and DCP go through the strategy like for the
    model itself.

    Example::

        ema = WrappedCopyEMA(model, strategy.wrap_model(copy.float()), strategy)
    """

    def __init__(self, model: nn.Module, copy: nn.Module, strategy) -> None:
        self.model, self.copy, self.strategy = model, copy, strategy

    @torch.no_grad()
    def update(self, decay: float) -> None:
        pairs = [
            (mine.detach(), theirs.detach().float())
            for mine, theirs in zip(self.copy.parameters(), self.model.parameters(), strict=True)
            if theirs.requires_grad
        ]
        if pairs:
            targets, sources = zip(*pairs, strict=True)
            torch._foreach_lerp_(list(targets), list(sources), 1.0 - decay)
        for mine, theirs in zip(self.copy.buffers(), self.model.buffers(), strict=True):
            mine.copy_(theirs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.strategy.full_model_state(self.copy).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        # Callers check the keys first; a LoRA run's EMA file holds only the adapters.
        self.strategy.load_full_model_state(self.copy, state, strict=False)

    def dcp_state(self) -> dict[str, torch.Tensor]:
        return self.strategy.dcp_state(self.copy)["model"]

    def load_dcp_state(self, state: dict[str, torch.Tensor]) -> None:
        self.strategy.load_dcp_state(self.copy, None, {"model": state})

    def local_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.copy.parameters())
