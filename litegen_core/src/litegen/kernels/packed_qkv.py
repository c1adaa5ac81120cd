"""FA4 on the packed qkv tensor in compiled blocks, so its backward writes one gradient buffer.

A DiT's attention splits one projection into q, k and v, three views of one tensor:

    q, k, v = self.qkv(x).view(b, n, 3, heads, dim).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v)

The attention backward returns dq, dk and dv as three tensors, and autograd copies them into one
buffer for the projection's backward: 0.11 ms a block on workload C, 3.0 ms of a 200 ms step
(docs/benchmarks.md). FA4 can write its gradients into any strided view, so in LiteGen's
compiled blocks :class:`PackQkvAttention`, an inductor pre-grad pass, hands FA4 the packed
tensor instead: ``litegen::fa4_packed_attention`` takes the (3, batch, heads, tokens, dim) view
that q, k and v come from, and its backward writes dq, dk and dv into one buffer laid out like
that view, so the projection gets its gradient without a copy.

The pass rewrites only the calls torch's flash backend, which is FA4 under ``attention_backend:
flash_attn``, would serve: no mask, dropout or GQA; fp16 or bf16 on CUDA; head dim a multiple of
8 up to 256; q, k and v taken from one tensor by ``unbind`` or indexing along a dimension of
size 3, each through the same transposes. It checks that the packed view it builds gives back q,
k and v exactly (shape, strides, offset). Other calls keep their SDPA. Eager runs are unchanged.

Example (``litegen.compile`` installs the pass around each compiled block's call):
    >>> with torch._inductor.config.patch(pre_grad_custom_pass=PackQkvAttention()):
    ...     out = compiled_block(x, c)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import statically_known_true

from litegen.kernels import fa4

PASS_VERSION = "1"  # bump when the rewrite changes: compiled graphs are cached under it


@torch.library.custom_op("litegen::fa4_packed_attention", mutates_args=())
def packed_attention(qkv: Tensor, is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    """FA4 attention of ``qkv.unbind(0)``, each (batch, heads, tokens, dim): output, log-sum-exp."""
    query, key, value = qkv.unbind(0)
    out, logsumexp = fa4.forward(query, key, value, is_causal=is_causal, scale=scale)[:2]
    return out, logsumexp


@packed_attention.register_fake
def _(qkv: Tensor, is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    query = qkv[0]  # fa4.forward's allocations
    return torch.empty_like(query), query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("litegen::fa4_packed_attention_backward", mutates_args=())
def packed_attention_backward(
    grad_out: Tensor,
    qkv: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    is_causal: bool,
    scale: float | None,
) -> Tensor:
    """The gradient of ``qkv``: FA4 writes dq, dk and dv into its three slices."""
    grad_qkv = torch.empty_like(qkv)  # qkv's own layout when it is dense (module docstring)
    grads = tuple(grad_qkv.unbind(0))
    fa4.backward_into(grads, grad_out, *qkv.unbind(0), out, logsumexp, is_causal, scale)
    return grad_qkv


@packed_attention_backward.register_fake
def _(grad_out, qkv, out, logsumexp, is_causal, scale) -> Tensor:
    return torch.empty_like(qkv)


def _save_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    qkv, ctx.is_causal, ctx.scale = inputs
    ctx.save_for_backward(qkv, *output)


def _backward(ctx: Any, grad_out: Tensor, _grad_logsumexp: Tensor | None) -> tuple:
    qkv, out, logsumexp = ctx.saved_tensors
    grad_qkv = packed_attention_backward(grad_out, qkv, out, logsumexp, ctx.is_causal, ctx.scale)
    return grad_qkv, None, None


packed_attention.register_autograd(_backward, setup_context=_save_for_backward)
PACKED_ATTENTION = torch.ops.litegen.fa4_packed_attention.default  # the op the pass inserts

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class PackQkvAttention(CustomGraphPass):
    """Inductor pre-grad pass: SDPA of q, k, v split from one tensor becomes one packed FA4 op.

    ``device_types`` are those whose calls it rewrites (FA4's: CUDA; tests add ``cpu`` with a
    stand-in for FA4). ``rewritten`` counts the calls rewritten so far (tests, logs). The
    ``uuid`` puts the pass into inductor's and AOTAutograd's cache keys.

    Example:
        >>> pack = PackQkvAttention()
        >>> pack(graph)  # an FX graph of Dynamo's, before autograd
        >>> pack.rewritten
        1
    """

    def __init__(self, device_types: tuple[str, ...] = ("cuda",)) -> None:
        self.device_types = device_types
        self.rewritten = 0

    def __call__(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in _SDPA:
                self.rewritten += _rewrite(graph, node, self.device_types)

    def uuid(self) -> str:
        return f"litegen.packed_qkv.{PASS_VERSION}.{','.join(self.device_types)}"


PACK_QKV = PackQkvAttention()  # the pass compiled blocks use (litegen.compile)


def _rewrite(graph: fx.Graph, sdpa: fx.Node, device_types: tuple[str, ...]) -> bool:
    """Replace one SDPA node with the packed op when it qualifies (module docstring)."""
    call = dict(zip(_SDPA_PARAMS, sdpa.args, strict=False)) | sdpa.kwargs
    is_causal, scale = call.get("is_causal", False), call.get("scale")
    if (
        call.get("attn_mask") is not None
        or call.get("dropout_p", 0.0) != 0.0
        or call.get("enable_gqa", False)
        or not isinstance(is_causal, bool)
        or not (scale is None or isinstance(scale, float))
    ):
        return False
    split = [call[name] for name in _SDPA_PARAMS[:3]]
    sources = [_split_source(node) for node in split]
    if None in sources or len({(s[0], s[1], s[3]) for s in sources}) != 1:
        return False
    if [s[2] for s in sources] != [0, 1, 2]:
        return False
    packed, dim, _, transforms = sources[0]
    order = _packed_order(_value(packed).dim(), dim, transforms)
    if order is None or not _is_flash_call(_value(packed), order, split, device_types):
        return False
    with graph.inserting_before(sdpa), _value(packed).fake_mode:
        view = packed
        if order != sorted(order):
            view = graph.call_method("permute", (packed, *order))
            view.meta["example_value"] = _value(packed).permute(order)
        result = graph.call_function(PACKED_ATTENTION, (view, is_causal, scale))
        result.meta["example_value"] = PACKED_ATTENTION(_value(view), is_causal, scale)
        out = graph.call_function(operator.getitem, (result, 0))
        out.meta["example_value"] = result.meta["example_value"][0]
    sdpa.replace_all_uses_with(out)
    graph.erase_node(sdpa)
    for node in split:
        _erase_unused_chain(graph, node)
    return True


_VIEW_OPS = ("transpose", "permute")  # per-tensor views the pass follows from q, k, v to the split


def _moved_dims(name: str, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The dims a ``transpose`` or ``permute`` call (its args after the tensor) names."""
    if name == "transpose":
        dims = tuple(args) or (kwargs.get("dim0"), kwargs.get("dim1"))
        if len(dims) != 2:
            return None
    else:
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        dims = tuple(dims or kwargs.get("dims", ()))
    return dims if dims and all(isinstance(d, int) for d in dims) else None


def _split_source(node: Any) -> tuple[fx.Node, int, int, tuple] | None:
    """``(packed, dim, index, transforms)`` when ``node`` is ``T(packed.unbind(dim)[index])``.

    ``T`` is a chain of transposes and permutes (``transforms``, the first applied first);
    ``packed[index]`` and ``packed.select(dim, index)`` count as the split too.
    """
    transforms: list[tuple[str, tuple[int, ...]]] = []
    while isinstance(node, fx.Node):
        name, args, kwargs = _op(node)
        if not args:
            return None
        if name in _VIEW_OPS:
            dims = _moved_dims(name, args[1:], kwargs)
            if dims is None:
                return None
            transforms.insert(0, (name, dims))
            node = args[0]
            continue
        if name == "getitem" and len(args) == 2 and isinstance(args[0], fx.Node):
            source, index = args
            source_name, source_args, source_kwargs = _op(source)
            if source_name == "unbind" and source_args:
                dim = source_args[1] if len(source_args) > 1 else source_kwargs.get("dim", 0)
                return _checked(source_args[0], dim, index, transforms)
            return _checked(source, 0, index, transforms)
        if name == "select":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            index = args[2] if len(args) > 2 else kwargs.get("index")
            return _checked(args[0], dim, index, transforms)
        return None
    return None


def _checked(packed: Any, dim: Any, index: Any, transforms: list) -> tuple | None:
    if not isinstance(packed, fx.Node) or not isinstance(dim, int) or not isinstance(index, int):
        return None
    value = _value(packed)
    if not isinstance(value, Tensor) or not statically_known_true(value.size(dim) == 3):
        return None
    return packed, dim % value.dim(), index, tuple(transforms)


def _packed_order(ndim: int, dim: int, transforms: tuple) -> list[int] | None:
    """The permutation of ``packed`` whose [i] is ``T(packed.unbind(dim)[i])``."""
    order = [d for d in range(ndim) if d != dim]
    for name, dims in transforms:
        if name == "transpose":
            a, b = (d % len(order) for d in dims)
            order[a], order[b] = order[b], order[a]
        else:
            if sorted(d % len(order) for d in dims) != list(range(len(order))):
                return None
            order = [order[d % len(order)] for d in dims]
    return [dim, *order]


def _is_flash_call(
    packed: Tensor, order: list[int], qkv: list[fx.Node], device_types: tuple[str, ...]
) -> bool:
    """Whether the packed view gives back q, k, v exactly, in a call the flash backend serves."""
    view = packed.permute(order)
    if view.dim() != 5 or view.dtype not in _FLASH_DTYPES:
        return False
    if view.device.type not in device_types:
        return False
    head_dim = view.size(-1)
    if not (statically_known_true(head_dim <= 256) and statically_known_true(head_dim % 8 == 0)):
        return False
    if not statically_known_true(view.stride(-1) == 1):
        return False
    for index, node in enumerate(qkv):
        expected, got = view[index], _value(node)
        if not isinstance(got, Tensor) or not all(
            statically_known_true(a == b)
            for a, b in zip(
                (*expected.shape, *expected.stride(), expected.storage_offset()),
                (*got.shape, *got.stride(), got.storage_offset()),
                strict=True,
            )
        ):
            return False
    return True


def _op(node: fx.Node) -> tuple[str, tuple, dict]:
    """A call's name, args and kwargs.

    The same for ``x.unbind(2)`` and ``torch.unbind(input=x, dim=2)``.
    """
    if node.op not in ("call_method", "call_function"):
        return "", (), {}
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    args, kwargs = node.args, dict(node.kwargs)
    for first in ("input", "self"):  # inductor's normalization passes name the tensor
        if first in kwargs:
            args = (kwargs.pop(first), *args)
    return name, args, kwargs


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _erase_unused_chain(graph: fx.Graph, node: Any) -> None:
    while (
        isinstance(node, fx.Node) and not node.users and node.op in ("call_method", "call_function")
    ):
        inputs = node.all_input_nodes
        graph.erase_node(node)
        node = inputs[0] if len(inputs) == 1 else None


__all__ = [
    "PACK_QKV",
    "PASS_VERSION",
    "PackQkvAttention",
    "packed_attention",
    "packed_attention_backward",
]
