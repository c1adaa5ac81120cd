"""Apply a sequence-parallel plan to a model, in place: hooks at block boundaries, Ulysses and
ring attention inside.

The split and the gather are module hooks, so they run outside the blocks' activation
checkpoints and compiled regions (which patch the blocks' ``forward``); a checkpointed block
saves only its shard. The planned attention modules get a subclass whose ``forward`` makes
their attention Ulysses (attention.py).

The sequence's length is known when its first tensor is split, in each forward, and the
attention calls read it (:class:`SequenceLayout`). Checkpointed blocks run their forward
again during backward, possibly after a later forward of the model with another length; the
gather's backward, which runs before any of the blocks', puts back the layout of its forward.

Example::

    sp = apply_sequence_parallel(model, plan_for(model), group)
    out = model(x)  # every rank of the group passes the same x and gets the whole output
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from litegen.parallel.sequence.attention import (
    STATE,
    one_rank_attention,
    sharded_attention_class,
)
from litegen.parallel.sequence.comm import gather, padded_length, shard
from litegen.parallel.sequence.sequence_plan import SequencePlan, Split, as_split, matching


@dataclass(frozen=True)
class SequenceLayout:
    """The current sequence: ``length`` tokens, padded to ``padded``, ``local`` per rank."""

    length: int
    padded: int
    local: int


class SequenceParallel:
    """One model's sequence-parallel state: its groups, and the layout of the current forward.

    ``group`` holds the sample's ranks (the split and the gather); its Ulysses group runs the
    all-to-alls (``sp_size`` ranks; ``group`` itself without a ring), and its ring group
    (``cp_size`` ranks) passes keys and values round (None: no ring).
    """

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        ulysses_group: dist.ProcessGroup | None = None,
        ring_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.name = type(model).__name__
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ulysses_group = group if ulysses_group is None else ulysses_group
        self.ulysses_size = dist.get_world_size(self.ulysses_group)
        self.ulysses_rank = dist.get_rank(self.ulysses_group)
        self.ring_group = ring_group
        self.ring_size = 1 if ring_group is None else dist.get_world_size(ring_group)
        if self.ulysses_size * self.ring_size != self.size:
            raise ValueError(
                f"sequence parallelism of {self.name}: a Ulysses group of {self.ulysses_size} "
                f"and a ring of {self.ring_size} ranks do not make the sequence group of "
                f"{self.size} (optimization.parallel.sp_size * cp_size must be its size)."
            )
        self.layout: SequenceLayout | None = None
        self.enabled = True
        # attention module -> its path, for error messages (read only when raising, so that
        # compiled blocks do not guard on it)
        self.paths: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

    def __deepcopy__(self, memo: dict) -> SequenceParallel:
        return self  # a copy of the model (an EMA copy, say) shares the group and its state

    def path_of(self, module: nn.Module | str) -> str:
        return module if isinstance(module, str) else self.paths.get(module, type(module).__name__)

    def current_layout(self, where: nn.Module | str) -> SequenceLayout:
        if self.layout is None:
            raise ValueError(
                f"sequence parallelism: {self.path_of(where)} of {self.name} ran before its "
                "plan split any sequence in this forward; the plan must split the tokens before "
                "the first planned attention module (split_inputs / split_outputs)."
            )
        return self.layout

    # -- what the hooks do ---------------------------------------------------------------------
    def start_forward(self) -> None:
        self.layout = None

    def split(self, value: Any, spec: Split, where: str) -> Any:
        """This rank's shard of ``value`` (a tensor, or each tensor of a tuple/list)."""
        if isinstance(value, tuple | list):
            return type(value)(self.split(v, spec, where) for v in value)
        if not isinstance(value, torch.Tensor):
            return value  # None, or a Python value: nothing to split
        if spec.ndim is not None and value.dim() != spec.ndim:
            return value
        length = value.shape[spec.dim]
        if length == 1:
            return value  # broadcast over the sequence
        if self.layout is None:
            padded = padded_length(length, self.size)
            if padded - length >= padded // self.ring_size:
                raise ValueError(
                    f"context parallelism: {where} of {self.name} has {length} tokens, too few "
                    f"for {self.size} ranks with a ring of {self.ring_size}: padded to "
                    f"{padded}, the last ring rank would hold padding only; lower "
                    "optimization.parallel.cp_size (or sp_size), or use longer sequences."
                )
            self.layout = SequenceLayout(length, padded, padded // self.size)
        elif self.layout.length != length:
            raise ValueError(
                f"sequence parallelism: the plan of {self.name} splits {where} with "
                f"{length} tokens along dim {spec.dim}, but this forward's sequence has "
                f"{self.layout.length}; every split tensor must be the sequence's (check the "
                "plan's dims)."
            )
        return shard(value, spec.dim, self.rank, self.size)

    def gather(self, value: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        """The whole sequence from every rank's shard, padding removed."""
        layout = self.current_layout(where)
        if isinstance(value, torch.Tensor):
            dim %= value.dim()
        if not isinstance(value, torch.Tensor) or value.shape[dim] != layout.local:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            raise ValueError(
                f"sequence parallelism: the plan of {self.name} gathers {where} along dim "
                f"{dim}, but its output ({shape}) does not hold {layout.local} tokens there; "
                "gather a tensor of the split tokens."
            )
        value = _RestoreLayout.apply(value, self, layout)
        return gather(value, dim, self.group).narrow(dim, 0, layout.length)


class _RestoreLayout(torch.autograd.Function):
    """Identity; its backward hands the blocks' recomputation the layout of its forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel, layout: SequenceLayout):
        ctx.sp, ctx.layout = sp, layout
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sp.layout = ctx.layout
        return grad, None, None


class OneRankShare(SequenceParallel):
    """The first rank's share of a sequence split over ``size`` ranks, computed by one process
    alone: the split keeps its tokens, the gather pads them back to the sequence's length, and
    attention runs on them (:func:`.attention.one_rank_attention`). For counting a rank's
    memory on meta (``inspect-config --estimate``); its outputs are not the model's."""

    def __init__(self, model: nn.Module, size: int) -> None:
        self.name = type(model).__name__
        self.group = self.ulysses_group = self.ring_group = None
        self.size, self.rank = size, 0
        self.ulysses_size, self.ulysses_rank, self.ring_size = 1, 0, 1
        self.layout = None
        self.enabled = True
        self.paths = weakref.WeakKeyDictionary()
        self.attention = one_rank_attention

    def gather(self, value: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        layout = self.current_layout(where)
        dim %= value.dim()
        pad = [0, 0] * (value.dim() - 1 - dim) + [0, layout.padded - layout.local]
        return F.pad(value, pad).narrow(dim, 0, layout.length)


def one_rank_share(model: nn.Module, plan: SequencePlan, size: int) -> SequenceParallel:
    """Install ``plan`` on ``model`` as the first of ``size`` ranks computing alone
    (:class:`OneRankShare`).

    Example::

        one_rank_share(wan_on_meta, plan_for(wan_on_meta), 8)  # then count its forward
    """
    return _install(model, plan, OneRankShare(model, size))


def apply_sequence_parallel(
    model: nn.Module,
    plan: SequencePlan,
    group: dist.ProcessGroup,
    *,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
) -> SequenceParallel:
    """Install ``plan`` on ``model`` for the ranks of ``group``; returns the model's state.

    Every rank of ``group`` must call the model with the same inputs; each gets the whole output.
    Attention is Ulysses over ``ulysses_group`` (default: ``group``) and, with a
    ``ring_group``, ring attention over it (:func:`litegen.parallel.mesh.sequence_groups`).

    Example::

        sp = apply_sequence_parallel(wan, plan_for(wan), mesh.get_group("sp"))
    """
    return _install(model, plan, SequenceParallel(model, group, ulysses_group, ring_group))


def _install(model: nn.Module, plan: SequencePlan, sp: SequenceParallel) -> SequenceParallel:
    plan.check(model)
    modules = dict(model.named_modules())
    attention = {
        path: (module, layout)
        for pattern, layout in plan.attention.items()
        for path, module in matching(model, pattern).items()
    }
    for path, (module, _) in attention.items():
        heads = getattr(module, "heads", None) or getattr(module, "num_heads", None)
        if isinstance(heads, int) and heads % sp.ulysses_size:
            raise ValueError(
                f"optimization.parallel.sp_size={sp.ulysses_size} must divide the attention "
                f"heads of {sp.name}, but {path} has {heads}; pick an sp_size that divides "
                f"{heads} (and split the rest of the sequence with cp_size, which has no such "
                "limit)."
            )
    # Registered first, so the model's own split hooks run after it.
    model.register_forward_pre_hook(lambda *_: sp.start_forward())
    for path, arguments in plan.split_inputs.items():
        hook = _SplitInputs(sp, modules[path], path, arguments)
        modules[path].register_forward_pre_hook(hook, with_kwargs=True)
    for path, outputs in plan.split_outputs.items():
        modules[path].register_forward_hook(_SplitOutputs(sp, path, outputs))
    for path, dim in plan.gather_outputs.items():
        modules[path].register_forward_hook(
            lambda _m, _a, out, dim=dim, where=f"{path}'s output": (
                sp.gather(out, dim, where) if sp.enabled else out
            )
        )
    classes: dict[tuple[type, str], type] = {}
    for path, (module, layout) in attention.items():
        key = (type(module), layout)
        if key not in classes:
            classes[key] = sharded_attention_class(type(module), sp, layout)
        module.__class__ = classes[key]
        sp.paths[module] = path
    return sp


class _SplitInputs:
    """Forward pre-hook: split the named (or numbered) arguments of one module."""

    def __init__(self, sp: SequenceParallel, module: nn.Module, path: str, arguments) -> None:
        self.sp = sp
        self.specs = {name: as_split(spec) for name, spec in arguments.items()}
        params = list(inspect.signature(module.forward).parameters)
        self.position = {
            name: name if isinstance(name, int) else params.index(name)
            for name in self.specs
            if isinstance(name, int) or name in params
        }
        unknown = [n for n in self.specs if n not in self.position]
        if unknown:
            raise ValueError(
                f"the sequence-parallel plan of {sp.name} splits arguments {unknown} of "
                f"{path or 'the model'}, whose forward takes {params}."
            )
        self.path = path or "the model"

    def __call__(self, module, args, kwargs):
        if not self.sp.enabled:
            return args, kwargs
        args = list(args)
        for name, spec in self.specs.items():
            where = f"argument {name!r} of {self.path}"
            if isinstance(name, str) and name in kwargs:
                kwargs[name] = self.sp.split(kwargs[name], spec, where)
            elif self.position[name] < len(args):
                index = self.position[name]
                args[index] = self.sp.split(args[index], spec, where)
        return tuple(args), kwargs


class _SplitOutputs:
    """Forward hook: split outputs (by index) of one module."""

    def __init__(self, sp: SequenceParallel, path: str, outputs) -> None:
        self.sp, self.path = sp, path
        self.specs = {index: as_split(spec) for index, spec in outputs.items()}

    def __call__(self, module, args, output):
        if not self.sp.enabled:
            return output
        single = isinstance(output, torch.Tensor)
        values = [output] if single else list(output)
        for index, spec in self.specs.items():
            values[index] = self.sp.split(values[index], spec, f"output {index} of {self.path}")
        return values[0] if single else type(output)(values)


@contextmanager
def sequence_parallel_off(model: nn.Module) -> Iterator[None]:
    """Run a sequence-parallel model on whole sequences, on one rank alone (e.g. sampling).

    Example::

        if gen.is_main_process:
            with sequence_parallel_off(gen.unwrap(model)):
                video = sample(model, prompt)
    """
    # The state sits on the attention modules' classes, so wrappers and copies find it too.
    states = {id(s): s for m in model.modules() if (s := getattr(type(m), STATE, None))}
    for sp in states.values():
        sp.enabled = False
    try:
        yield
    finally:
        for sp in states.values():
            sp.enabled = True


# Dynamo's switch for side effects in checkpointed code (compile_context).
_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def compile_context() -> AbstractContextManager:
    """What a compiled block with sequence-parallel attention enters around each call.

    The attention enters a torch-function mode inside each block (:mod:`.attention`). Inside an
    activation checkpoint Dynamo counts that as a side effect to replay in the recomputation and
    breaks the graph; the mode's effect is already in the traced graph, which the compiled
    backward recomputes, so Dynamo is told not to replay it (torch releases without the switch
    keep the graph break).

    Example::

        compile_blocks(model, compile_cfg, block_contexts=[compile_context])
    """
    if not hasattr(torch._dynamo.config, _SKIP_REPLAY):
        return nullcontext()
    return torch._dynamo.config.patch(**{_SKIP_REPLAY: True})


__all__ = [
    "OneRankShare",
    "SequenceLayout",
    "SequenceParallel",
    "apply_sequence_parallel",
    "compile_context",
    "one_rank_share",
    "sequence_parallel_off",
]
