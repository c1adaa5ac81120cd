"""The one door to torch's private ring attention (``torch.distributed.tensor.experimental``).

torch's context parallelism keeps its ring in private functions: ``_templated_ring_attention``
(forward: pass the keys and values round the group, merge the partial results by their
log-sum-exp) and ``_templated_ring_attention_backward`` (recompute each block's gradients
against the merged output and pass the key/value gradients round after their owners' keys),
both generic over the attention op they call per block. LiteGen calls them with its own block
op (:mod:`litegen.parallel.sequence.ring`), so nothing else of torch's context parallelism
(DTensor dispatch, buffer sharding) is involved. Only this module names the private API; the
versions it was tested on are :data:`TESTED_TORCH`.

Example::

    out, lse = ring_forward(group, op, query, key, value)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# torch releases whose private ring functions were run here: 2.13 in the CPU tests, 2.11 on
# the GPU node (tests/gpu/test_ring_gpu.py, scripts/bench/bench_ring.py).
TESTED_TORCH = ("2.11", "2.13")

try:  # where torch keeps it since 2.9 (torch 2.13 re-exports only the forward elsewhere)
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _cp_options,
        _RotateMethod,
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )
except ImportError:  # pragma: no cover - where older releases kept the same functions
    try:
        from torch.distributed.tensor.experimental._attention import (  # type: ignore
            _cp_options,
            _RotateMethod,
            _templated_ring_attention,
            _templated_ring_attention_backward,
        )
    except ImportError:
        _templated_ring_attention = _templated_ring_attention_backward = None

# The ring's sequence dimension: (batch, heads, tokens, head_dim).
SEQ_DIM = 2


def available() -> bool:
    """Whether this torch has the ring functions LiteGen builds on."""
    return _templated_ring_attention is not None


def require() -> None:
    """Raise ``ValueError`` naming the field and the fix when this torch has no ring."""
    if not available():
        raise ValueError(
            "optimization.parallel.cp_size > 1 builds on torch's ring attention "
            "(torch.distributed.tensor.experimental), which torch "
            f"{torch.__version__} lacks (tested on {', '.join(TESTED_TORCH)}); use a tested "
            "torch, or split the sequence with sp_size alone (cp_size: 1)."
        )


@contextmanager
def _options() -> Iterator[None]:
    """torch's ring options for LiteGen's calls, restored after: no load balancing (it is for
    causal attention), keys and values passed to the next rank (a ring, not an all-gather of
    every chunk), merges in fp32."""
    saved = (_cp_options.enable_load_balance, _cp_options.rotate_method, _cp_options.convert_to_f32)
    _cp_options.enable_load_balance = False
    _cp_options.rotate_method = _RotateMethod.ALL_TO_ALL
    _cp_options.convert_to_f32 = True
    try:
        yield
    finally:
        (
            _cp_options.enable_load_balance,
            _cp_options.rotate_method,
            _cp_options.convert_to_f32,
        ) = saved


def ring_forward(
    group: dist.ProcessGroup,
    op: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output and log-sum-exp of ``query`` against every rank's ``key``/``value``.

    ``op(q, k, v, is_causal=False)`` returns one block's ``(out, lse)``; at call ``i`` it gets
    the keys and values of group rank ``(rank - i) % size``.
    """
    with _options():
        out, lse, *_ = _templated_ring_attention(group, SEQ_DIM, op, query, key, value)
    return out, lse


def ring_backward(
    group: dist.ProcessGroup,
    op: Any,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``query`` and of this rank's ``key``/``value`` (the ring's adjoint).

    ``op(grad_out=, query=, key=, value=, out=, logsumexp=, is_causal=False)`` returns one
    block's ``(grad_query, grad_key, grad_value)``, in the forward's block order.
    """
    with _options():
        grads = _templated_ring_attention_backward(
            group, SEQ_DIM, op, grad_out, "grad_out", query, key, value, out, lse, is_causal=False
        )
    return grads[0], grads[1], grads[2]


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries merged by their log-sum-exp, in fp32 (the
    update torch's ring applies between its blocks)."""
    lse32, block32 = lse.float().unsqueeze(-1), block_lse.float().unsqueeze(-1)
    merged = out.float() - torch.sigmoid(block32 - lse32) * (out.float() - block_out.float())
    merged_lse = lse32 - torch.nn.functional.logsigmoid(lse32 - block32)
    return merged.to(out.dtype), merged_lse.squeeze(-1).to(lse.dtype)


__all__ = [
    "SEQ_DIM",
    "TESTED_TORCH",
    "available",
    "merge",
    "require",
    "ring_backward",
    "ring_forward",
]
