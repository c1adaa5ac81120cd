"""Wan's self-attention with its query and key norms and rotary embedding fused (Triton).

diffusers' ``WanAttention`` layers normalise the query and key across heads, then rotate them
(:mod:`litegen.experimental.qk_norm_rope` does both in one pass each way).
:func:`apply_fused_wan_attention` gives each self-attention layer of a model a processor that
projects the query, key and value in one GEMM (the three weights concatenated), runs that op on
the query and the key, then torch's ``scaled_dot_product_attention`` as diffusers does.

With peft's LoRA on the three projections, the adapters are fused too: one GEMM for their three
``lora_A`` (concatenated) and one for their ``lora_B`` (block-diagonal, each scale multiplied
in), so the hidden states are read once for six GEMMs' work, forward and backward. Projections
with hooks, dropout, DoRA or other variants, merged or disabled adapters run as their own
modules. Parameters, module tree and ``state_dict`` stay the model's own. A call this processor does not cover (cross-attention, a
mask, no rotary embedding, diffusers' own context parallelism or attention backend, fused
projections) runs the layer's original processor.

Example::

    apply_fused_wan_attention(wan)  # before checkpointing, compile and wrapping
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from litegen.experimental.qk_norm_rope import qk_norm_rope


class FusedWanSelfAttention:
    """A ``WanAttention`` processor for self-attention with rotary embeddings; module docstring."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
        **kwargs: Any,
    ) -> Tensor:
        if not _covers(attn, self.original, encoder_hidden_states, attention_mask, rotary_emb):
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs
            )
        query, key, value = _project(attn, hidden_states)
        cos, sin = rotary_emb
        query = qk_norm_rope(query, attn.norm_q.weight, cos, sin, _eps(attn.norm_q))
        key = qk_norm_rope(key, attn.norm_k.weight, cos, sin, _eps(attn.norm_k))
        # (B, L, H * D) -> (B, H, L, D), the layout scaled_dot_product_attention takes.
        query, key, value = (
            t.unflatten(2, (attn.heads, -1)).transpose(1, 2) for t in (query, key, value)
        )
        out = F.scaled_dot_product_attention(query, key, value)
        out = out.transpose(1, 2).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


def _project(attn: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value: one GEMM over the concatenated weights (module docstring)."""
    projections = (attn.to_q, attn.to_k, attn.to_v)
    adapters = _shared_lora_adapters(projections)
    if adapters is None:
        return tuple(p(hidden_states) for p in projections)
    bases = [getattr(p, "base_layer", p) for p in projections]
    rows = hidden_states.flatten(0, -2)
    qkv = torch.addmm(
        torch.cat([b.bias for b in bases]), rows, torch.cat([b.weight for b in bases]).t()
    )
    for name in adapters:
        down = torch.cat([p.lora_A[name].weight for p in projections])
        up = torch.block_diag(*(p.lora_B[name].weight * p.scaling[name] for p in projections))
        # peft casts the input to the adapter's dtype (a no-op under autocast's GEMMs).
        low_rank = F.linear(rows.to(down.dtype), down)
        if low_rank.dtype == qkv.dtype:  # the sum in the GEMM: no pass of its own over qkv
            qkv = torch.addmm(qkv, low_rank, up.t())
        else:  # FP32 adapters on a bf16 base without autocast: peft's promotion, then its cast
            qkv = (qkv + F.linear(low_rank, up)).to(qkv.dtype)
    return qkv.unflatten(0, hidden_states.shape[:-1]).chunk(3, dim=-1)


def _shared_lora_adapters(projections: tuple[nn.Module, ...]) -> tuple[str, ...] | None:
    """The active LoRA adapters of three projections that can run as one GEMM each way: ``()``
    for plain linear layers, None when any projection must run as its own module."""
    if all(_plain_linear(p) for p in projections):
        return ()
    if not all(_plain_lora(p) for p in projections):
        return None
    active = {tuple(p.active_adapters) for p in projections}
    return active.pop() if len(active) == 1 else None


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.bias is not None and not _hooked(module)


def _plain_lora(module: nn.Module) -> bool:
    """A peft LoRA ``Linear`` computing ``base(x) + B(A(x)) * scale`` for each active adapter."""
    if type(module).__module__ != "peft.tuners.lora.layer" or type(module).__name__ != "Linear":
        return False
    if _hooked(module) or module.disable_adapters or module.merged:
        return False
    return _plain_linear(module.base_layer) and all(
        name in module.lora_A
        and name not in getattr(module, "lora_variant", {})  # DoRA and other variants
        and not getattr(module, "use_dora", {}).get(name, False)  # peft before lora_variant
        and isinstance(module.lora_dropout[name], nn.Identity)
        and module.lora_B[name].bias is None
        and not _hooked(module.lora_A[name])
        and not _hooked(module.lora_B[name])
        for name in module.active_adapters
    )


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _eps(norm: nn.Module) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps


def _covers(
    attn: nn.Module,
    original: Any,
    encoder_hidden_states: Tensor | None,
    attention_mask: Tensor | None,
    rotary_emb: tuple[Tensor, Tensor] | None,
) -> bool:
    return (
        encoder_hidden_states is None
        and attention_mask is None
        and rotary_emb is not None
        and not getattr(attn, "fused_projections", False)
        and getattr(original, "_attention_backend", None) is None
        and getattr(original, "_parallel_config", None) is None
    )


def is_wan_self_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a diffusers ``WanAttention`` this module's processor can serve.

    Example::

        is_wan_self_attention(wan.blocks[0].attn1), is_wan_self_attention(wan.blocks[0].attn2)
    """
    if type(module).__name__ != "WanAttention" or getattr(module, "is_cross_attention", True):
        return False
    processor = getattr(module, "processor", None)
    if type(processor).__name__ not in ("WanAttnProcessor", FusedWanSelfAttention.__name__):
        return False
    # RMSNorm across heads (Wan's "rms_norm_across_heads"), with a weight.
    width = module.to_q.out_features
    return all(
        isinstance(norm, nn.RMSNorm)
        and norm.weight is not None
        and tuple(norm.normalized_shape) == (width,)
        for norm in (module.norm_q, module.norm_k)
    ) and all(linear.bias is not None for linear in (module.to_q, module.to_k, module.to_v))


def apply_fused_wan_attention(model: nn.Module) -> int:
    """Give every Wan self-attention layer of ``model`` the fused processor; returns how many.

    In place and idempotent; call before checkpointing, compile and wrapping, as ``prepare``
    does.

    Example::

        apply_fused_wan_attention(wan)
    """
    swapped = 0
    for module in model.modules():
        if not is_wan_self_attention(module):
            continue
        if not isinstance(module.processor, FusedWanSelfAttention):
            module.set_processor(FusedWanSelfAttention(module.processor))
        swapped += 1
    return swapped


__all__ = ["FusedWanSelfAttention", "apply_fused_wan_attention", "is_wan_self_attention"]
