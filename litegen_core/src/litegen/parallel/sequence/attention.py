"""Ulysses and ring attention: ``F.scaled_dot_product_attention`` on sequence shards, made exact.

Inside an attention module of the plan, query, key and value hold this rank's shard of the
split tokens for all ``H`` heads: ``(B, H, S/N, D)``. One all-to-all turns them into all ``S``
tokens for ``H/N`` heads, attention runs on whole sequences, and one all-to-all turns the output
back. For joint attention the text tokens, whole on every rank, are cut to this rank's heads
before attention and their output is all-gathered over heads after it.

The interception is a ``TorchFunctionMode`` entered around the module's own ``forward``
(:func:`sharded_attention_class`), so the model's attention code is unchanged, every SDPA
kernel choice (``attention_context``) still applies to the call it makes, and the forward that
activation checkpointing runs again in backward is intercepted the same way. ``torch.compile``
traces the mode and the all-to-alls into a compiled block's graph.

With a ring group (``cp_size > 1``), the all-to-all gives this rank all tokens of its ring
chunk, and :func:`litegen.parallel.sequence.ring.ring_attention` attends them to every ring
rank's chunk; text whole on every rank is one local block (ring.py).

Padding: a sequence that does not divide by ``N`` is padded at its end (``comm.shard``). Ulysses
alone cuts it off after the all-to-all, so attention never sees it, and puts it back (as zeros)
before the reverse all-to-all; the ring cuts it off each chunk before its kernel.

Example::

    attn.__class__ = sharded_attention_class(type(attn), sp, "self")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from litegen.parallel.sequence.comm import gather, heads_to_seq, seq_to_heads
from litegen.parallel.sequence.ring import (
    RingSpec,
    additive_mask,
    chunk_lengths,
    chunk_masks,
    ring_attention,
)

if TYPE_CHECKING:
    from litegen.parallel.sequence.apply import SequenceParallel


class _UlyssesMode(TorchFunctionMode):
    """Reroutes each ``F.scaled_dot_product_attention`` call to :func:`ulysses_attention` (or
    to ``sp.attention``: :func:`one_rank_attention` for a rank's share counted alone)."""

    def __init__(self, sp: SequenceParallel, layout: str, module: nn.Module) -> None:
        super().__init__()
        self.sp, self.layout, self.module = sp, layout, module
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            attention = getattr(self.sp, "attention", ulysses_attention)
            return attention(func, self.sp, self.layout, self.module, *args, **kwargs)
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and getattr(torch.Tensor, name, None) is func:
            # A tensor method, called as one: Dynamo traces ``x.unflatten(...)`` into the graph,
            # but breaks the graph on the Python body of ``Tensor.unflatten`` that ``func`` is.
            return getattr(args[0], name)(*args[1:], **kwargs)
        return func(*args, **kwargs)


def sharded_attention_class(cls: type[nn.Module], sp: SequenceParallel, layout: str) -> type:
    """A subclass of ``cls`` whose ``forward`` runs ``cls.forward`` with Ulysses attention.

    :func:`apply_sequence_parallel` sets it as the ``__class__`` of each planned attention
    module (as ``fully_shard`` does with its own subclass), so that every block shares one
    ``forward``: ``torch.compile`` compiles the blocks once, where a per-module patched
    ``forward`` would be a guard that recompiles each block.

    Example::

        attn.__class__ = sharded_attention_class(type(attn), sp, "self")
    """

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not sp.enabled:
            return cls.forward(self, *args, **kwargs)
        mode = _UlyssesMode(sp, layout, self)
        with mode:
            out = cls.forward(self, *args, **kwargs)
        if mode.calls == 0:
            raise ValueError(
                f"sequence parallelism: the attention module {sp.path_of(self)} did not call "
                "torch.nn.functional.scaled_dot_product_attention, so its split tokens never "
                "met; use an attention implementation that calls it (for diffusers models, the "
                "default 'native' attention backend)."
            )
        return out

    return type(f"SequenceParallel{cls.__name__}", (cls,), {"forward": forward, STATE: sp})


# The class attribute of :func:`sharded_attention_class`'s classes that holds their state.
STATE = "litegen_sequence_parallel"


def _sdpa_arguments(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **rest
):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, rest


def ulysses_attention(
    sdpa: Callable,
    sp: SequenceParallel,
    layout: str,
    module: nn.Module,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """``sdpa(*args, **kwargs)`` for the split tokens of ``sp``'s current sequence (module doc),
    called inside the attention ``module``.

    ``layout`` says where the split tokens sit in the call's sequence (``plan.LAYOUTS``).
    """
    query, key, value, mask, dropout_p, is_causal, scale, rest = _sdpa_arguments(*args, **kwargs)
    seq = sp.current_layout(module)
    n, rank = sp.ulysses_size, sp.ulysses_rank
    if is_causal:
        raise ValueError(
            f"sequence parallelism: {sp.path_of(module)} asks for causal attention, which it "
            "does not support."
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[1] % n:
            raise ValueError(
                f"sequence parallelism: {sp.path_of(module)} calls attention with a {name} of "
                f"shape {tuple(t.shape)}; Ulysses needs (batch, heads, tokens, head_dim) with "
                f"the heads divisible by optimization.parallel.sp_size={n}."
            )
    length = query.shape[-2]
    text = 0 if layout == "self" else length - seq.local
    if key.shape[-2] != length or value.shape[-2] != length or text < 0:
        raise ValueError(
            f"sequence parallelism: {sp.path_of(module)} is planned as {layout!r} attention "
            f"over this rank's {seq.local} split tokens, but its query, key and value have "
            f"{length}, {key.shape[-2]} and {value.shape[-2]} tokens; fix the plan's attention "
            "entry (cross-attention to whole text needs none)."
        )
    text_first = layout == "text_first"
    # Where the split tokens start, in this call's sequence and in the attention's below.
    video_at = text if text_first else 0
    parts = (query, key, value)

    video = [t.narrow(2, video_at, seq.local) for t in parts]
    if n > 1:
        video = _seq_to_heads(video, sp)
    texts = None
    if text:
        text_at = 0 if text_first else seq.local
        texts = [_own_heads(t.narrow(2, text_at, text), rank, n) for t in parts]
    mask = _local_mask(mask, video[0].shape[1], text + seq.length, rank, sp, module)
    if sp.ring_group is not None:
        out_video, out_text = _ring(
            sp, module, video, texts, mask, text_first, dropout_p, scale, rest
        )
    else:
        out_video, out_text = _whole(
            sdpa, seq, video, texts, mask, text_first, dropout_p, scale, rest
        )
    if n > 1:
        out_video = heads_to_seq(out_video, sp.ulysses_group)
    if not text:
        return out_video
    if n > 1:
        out_text = gather(out_text, 1, sp.ulysses_group)
    pieces = (out_text, out_video) if text_first else (out_video, out_text)
    return torch.cat(pieces, dim=2)


def _whole(sdpa, seq, video, texts, mask, text_first, dropout_p, scale, rest):
    """Ulysses alone: attention over the whole sequence, padding cut off and put back."""
    if seq.padded != seq.length:
        video = [t.narrow(2, 0, seq.length) for t in video]
    if texts:
        pairs = [(t, v) if text_first else (v, t) for t, v in zip(texts, video, strict=True)]
        q, k, v = (torch.cat(pair, dim=2) for pair in pairs)
    else:
        q, k, v = video
    out = sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, **rest)
    # Here the sequence is [text, all split tokens] or [all split tokens, text].
    text = texts[0].shape[2] if texts else 0
    out_video = out.narrow(2, text if text_first else 0, seq.length)
    if seq.padded != seq.length:
        out_video = F.pad(out_video, (0, 0, 0, seq.padded - seq.length))
    out_text = out.narrow(2, 0 if text_first else seq.length, text) if texts else None
    return out_video, out_text


def _ring(sp, module, video, texts, mask, text_first, dropout_p, scale, rest):
    """Ring attention over the ring group's chunks (after Ulysses, its ``cp_rank``-th chunk of
    the padded sequence for this rank's heads). Text queries attend every chunk here, on every
    ring rank alike, and the text keys are one local block."""
    seq = sp.current_layout(module)
    if dropout_p or any(rest.values()):
        raise ValueError(
            f"context parallelism: {sp.path_of(module)} calls attention with dropout or "
            f"{sorted(k for k, v in rest.items() if v)}, which ring attention does not support; "
            "set optimization.parallel.cp_size: 1 for this model."
        )
    chunk = seq.padded // sp.ring_size
    lengths = chunk_lengths(seq.length, chunk, sp.ring_size)
    text = texts[0].shape[2] if texts else 0
    chunk_mask = local_mask = None
    if mask is not None:
        if mask.dim() >= 2 and mask.shape[-2] != 1:
            raise ValueError(
                f"context parallelism: {sp.path_of(module)} passes an attention mask with a row "
                "per query; ring attention takes key masks only (1 in the second-last "
                "dimension); set optimization.parallel.cp_size: 1 for this model."
            )
        mask = additive_mask(mask, video[0].dtype)
        chunk_mask = chunk_masks(mask, text if text_first else 0, chunk, lengths)
        if text:
            local_mask = mask.narrow(-1, 0 if text_first else seq.length, text)
    q, k, v = video
    if texts:
        q = torch.cat([q, texts[0]], dim=2)
    spec = RingSpec(sp.ring_group, lengths, chunk_mask, local_mask, scale)
    local = (texts[1], texts[2]) if texts else (None, None)
    out = ring_attention(q, k, v, spec, *local)
    return out.narrow(2, 0, chunk), (out.narrow(2, chunk, text) if texts else None)


def one_rank_attention(
    sdpa: Callable,
    sp: SequenceParallel,
    layout: str,
    module: nn.Module,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """Attention of one rank's split tokens (and the whole text) alone, with no collective: the
    rank's tensors have the sizes Ulysses and the ring give it (tokens / N for every head, or
    every token for heads / N), so counting its memory on meta needs no group. The mask, built
    over the whole sequence, is cut to the keys the call has."""
    query, key, value, mask, dropout_p, is_causal, scale, rest = _sdpa_arguments(*args, **kwargs)
    if mask is not None and mask.shape[-1] != key.shape[-2]:
        seq = sp.current_layout(module)
        text = key.shape[-2] - seq.local
        if layout == "text_first":
            mask = mask.narrow(-1, 0, text + seq.local)
        else:  # [video, text]: this rank's first tokens, then the text after the whole video
            whole = mask.shape[-1] - text
            mask = torch.cat([mask.narrow(-1, 0, seq.local), mask.narrow(-1, whole, text)], -1)
    return sdpa(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        **rest,
    )


def _own_heads(x: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """This rank's head group of a (batch, heads, tokens, dim) tensor that every rank holds."""
    heads = x.shape[1] // n
    return x.narrow(1, rank * heads, heads)


def _seq_to_heads(parts: list[torch.Tensor], sp: SequenceParallel) -> list[torch.Tensor]:
    """All-to-all of query, key and value: one collective when their shapes agree."""
    if all(t.shape == parts[0].shape for t in parts):
        batch = parts[0].shape[0]
        joined = seq_to_heads(torch.cat(parts, dim=0), sp.ulysses_group)
        return list(joined.split(batch, dim=0))
    return [seq_to_heads(t, sp.ulysses_group) for t in parts]


def _local_mask(
    mask: torch.Tensor | None,
    heads: int,
    length: int,
    rank: int,
    sp: SequenceParallel,
    module: nn.Module,
) -> torch.Tensor | None:
    """The attention mask for this rank's heads over the whole sequence.

    A mask must describe the whole sequence (its last dimension: every key), as the model
    builds it before the split; a per-head mask is cut to this rank's heads.
    """
    if mask is None:
        return None
    if mask.shape[-1] != length or (mask.dim() >= 2 and mask.shape[-2] not in (1, length)):
        raise ValueError(
            f"sequence parallelism: {sp.path_of(module)} passes an attention mask of shape "
            f"{tuple(mask.shape)}, but a mask must cover the whole sequence of {length} tokens "
            "(keys in the last dimension, 1 or every query in the one before)."
        )
    if mask.dim() == 4 and mask.shape[1] > 1:
        mask = mask.narrow(1, rank * heads, heads)
    return mask


__all__ = ["STATE", "one_rank_attention", "sharded_attention_class", "ulysses_attention"]
