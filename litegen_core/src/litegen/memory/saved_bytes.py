"""What one forward saves for backward, attributed to a model's blocks, counted on any device.

:func:`count_saved_bytes` runs a forward (usually on the meta device, where tensors have shapes
and dtypes but no memory and no compute) under ``saved_tensors_hooks`` and notes every tensor
autograd saves, by storage, together with the block that was running. Per block:

* ``activation_bytes``: what it saves without checkpointing, leaving out its inputs, the
  parameters and buffers, and its outputs (alive in either mode), as
  :mod:`litegen.memory.budget` defines it;
* ``input_bytes``: its tensor inputs that no other block also takes (checkpointing keeps them;
  shared ones, like text embeddings, stay either way and count once, outside the blocks);
* ``op_output_bytes`` and ``widening_bytes``: of ``activation_bytes``, the outputs of matmuls,
  convolutions and attention, and of those the outputs of linear layers at least
  ``RECOMPUTE_WIDENING`` times wider than their input: what the ``ops_all`` and ``ops``
  checkpointing policies keep of a checkpointed block;
* ``output_bytes``: its outputs, the size of the gradient that reaches it in backward.

``outside_bytes`` is what the forward saves outside every block, the blocks' shared inputs
included. Storages are told apart by identity (a view saves its base's storage once), which
works on the meta device, where every storage reports address 0.

``scaled_dot_product_attention`` is counted as a flash or memory-efficient kernel: it saves
``q``, ``k``, ``v``, the output (laid out heads-inner, as those kernels return it) and a float32
logsumexp per query row, never the ``L x L`` matrix the math kernel (the only one on a CPU or the meta device) would save. A
:class:`torch.overrides.TorchFunctionMode` replaces the call by an autograd function that saves
exactly those, computing the real output on real tensors; its backward is not implemented, so
the counted forward is for counting only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from litegen.memory.checkpointing import RECOMPUTE_WIDENING

# Torch functions whose outputs the ``ops_all`` policy keeps (litegen.memory.checkpointing).
_KEPT_BY_OPS = frozenset(
    {F.linear, torch.matmul, torch.bmm, torch.baddbmm, F.conv1d, F.conv2d, F.conv3d}
)


@dataclass
class BlockSaves:
    """What one block saves for backward (module doc)."""

    activation_bytes: int = 0
    input_bytes: int = 0
    op_output_bytes: int = 0
    widening_bytes: int = 0
    output_bytes: int = 0


@dataclass
class SavedBytes:
    """What a forward saved: per block, in forward order, and outside every block."""

    blocks: dict[str, BlockSaves] = field(default_factory=dict)
    outside_bytes: int = 0


class _FlashLikeAttention(torch.autograd.Function):
    """Saves what a flash attention kernel saves: q, k, v, the output and the logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v, compute):  # type: ignore[override]
        if compute is None and q.dim() == 4:
            # (batch, heads, queries, dim) laid out as (batch, queries, heads, dim), as flash
            # kernels return it: merging the heads back after a transpose is then a view.
            b, h, length, _ = q.shape
            out = q.new_empty((b, length, h, v.shape[-1])).transpose(1, 2)
        elif compute is None:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        else:
            with torch.no_grad():
                out = compute()
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise RuntimeError("attention counted as a flash kernel has no backward: count only")


class AttentionAsFlash(TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` as a flash kernel would save (module doc); notes
    the output bytes of the functions the ``ops`` policies keep through ``on_output``.

    Example:
        >>> q = torch.empty(1, 2, 4096, 64, device="meta", requires_grad=True)
        >>> with AttentionAsFlash():
        ...     F.scaled_dot_product_attention(q, q, q).shape
        torch.Size([1, 2, 4096, 64])
    """

    def __init__(self, on_output: Callable[[torch.Tensor, bool], None] | None = None) -> None:
        super().__init__()
        self.on_output = on_output

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value")
            q, k, v = (*args[:3], *(kwargs[n] for n in names[len(args[:3]) :]))
            real = q.device.type != "meta"
            compute = (lambda: func(*args, **kwargs)) if real else None
            out = _FlashLikeAttention.apply(q, k, v, compute)
            self._note(out, widening=False)
            return out
        out = func(*args, **kwargs)
        if func in _KEPT_BY_OPS and isinstance(out, torch.Tensor):
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            widening = (
                func is F.linear
                and isinstance(weight, torch.Tensor)
                and weight.dim() == 2
                and weight.shape[0] >= RECOMPUTE_WIDENING * weight.shape[1]
            )
            self._note(out, widening)
        return out

    def _note(self, out: torch.Tensor, widening: bool) -> None:
        if self.on_output is not None:
            self.on_output(out, widening)


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (a block's arguments or outputs)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, tuple | list):
        return [t for item in tree for t in _tensors(item)]
    return []


class _Counter:
    """The hooks' shared state: the running block, and every storage seen, by identity."""

    def __init__(self, model: nn.Module, paths: list[str]) -> None:
        self.paths = paths
        self.running: str | None = None
        self.keep: list[Any] = []  # storages stay referenced, so their ids stay unique
        self.nbytes: dict[int, int] = {}
        self.kept = self._ids([*model.parameters(), *model.buffers()])
        self.saved: dict[int, tuple[int, str | None]] = {}  # storage -> (bytes, block)
        self.inputs: dict[str, set[int]] = {p: set() for p in paths}
        self.outputs: dict[str, set[int]] = {p: set() for p in paths}
        self.op_outputs: dict[int, bool] = {}  # storage -> output of a widening linear

    def _id(self, t: torch.Tensor) -> int | None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # subclasses without one storage
            return None
        self.keep.append(storage)
        self.nbytes[id(storage)] = storage.nbytes()
        return id(storage)

    def _ids(self, tree: Any) -> set[int]:
        found = (self._id(t) for t in _tensors(tree))
        return {i for i in found if i is not None}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = self._id(t)
        if sid is not None and sid not in self.kept and sid not in self.saved:
            self.saved[sid] = (self.nbytes[sid], self.running)
        return t

    def output(self, out: torch.Tensor, widening: bool) -> None:
        if self.running is not None:
            sid = self._id(out)
            if sid is not None:
                self.op_outputs[sid] = widening

    def enter(self, path: str, args: Any, kwargs: Any) -> None:
        self.running = path
        self.inputs[path] |= self._ids((args, kwargs)) - self.kept

    def leave(self, path: str, out: Any) -> None:
        self.outputs[path] |= self._ids(out)
        self.running = None

    def result(self) -> SavedBytes:
        taken: dict[int, int] = {}  # input storage -> how many blocks take it
        for ids in self.inputs.values():
            for sid in ids:
                taken[sid] = taken.get(sid, 0) + 1
        own = {p: {s for s in ids if taken[s] == 1} for p, ids in self.inputs.items()}
        counted: set[int] = set()
        blocks = {}
        for path in self.paths:
            saves = BlockSaves()
            left_out = own[path] | self.inputs[path] | self.outputs[path]
            for sid, (size, block) in self.saved.items():
                if block == path and sid not in left_out:
                    saves.activation_bytes += size
                    counted.add(sid)
                    if sid in self.op_outputs:
                        saves.op_output_bytes += size
                        saves.widening_bytes += size if self.op_outputs[sid] else 0
            saves.input_bytes = sum(self.nbytes[s] for s in own[path])
            saves.output_bytes = sum(self.nbytes[s] for s in self.outputs[path])
            counted |= own[path]
            blocks[path] = saves
        outside = sum(size for sid, (size, _) in self.saved.items() if sid not in counted)
        return SavedBytes(blocks, outside)


def count_saved_bytes(model: nn.Module, paths: list[str], forward: Callable[[], Any]) -> SavedBytes:
    """Run ``forward()`` once and count what it saves for backward, per block at ``paths``.

    ``paths`` are submodules of ``model`` called in that order (its repeated blocks); what the
    forward returns is dropped. On the meta device this takes no memory and no compute.

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> x = torch.empty(4, 8, device="meta")
        >>> saved = count_saved_bytes(net, ["0", "1", "2"], lambda: net(x).sum())
        >>> saved.blocks["1"].activation_bytes, saved.blocks["2"].input_bytes  # GELU saves its input
        (0, 512)
    """
    counter = _Counter(model, list(paths))
    handles = []
    for path in paths:
        module = model.get_submodule(path)

        def pre(_m: nn.Module, args: Any, kwargs: Any, path: str = path) -> None:
            counter.enter(path, args, kwargs)

        def post(_m: nn.Module, _a: Any, _k: Any, out: Any, path: str = path) -> None:
            counter.leave(path, out)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with saved_tensors_hooks(counter.pack, lambda t: t), AttentionAsFlash(counter.output):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return counter.result()


__all__ = ["AttentionAsFlash", "BlockSaves", "SavedBytes", "count_saved_bytes"]
