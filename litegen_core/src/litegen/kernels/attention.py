"""Which scaled-dot-product-attention kernel a run uses (``optimization.kernels.attention_backend``).

Models call ``F.scaled_dot_product_attention`` as usual; the trainer enters
:func:`attention_context` around each step's micro-batches, forward *and* backward. The backward
matters: activation checkpointing re-runs the forward there, and the recomputed attention must
use the same kernel as the first forward.

Backends:

- ``auto``: on CUDA, torch's own kernels in the order cuDNN, flash, memory-efficient, math;
  each call takes the first that supports its shapes and dtypes. cuDNN comes first because it
  measured fastest at DiT head sizes on Hopper (benchmarks/); ``auto`` pins that order for torch
  versions whose default differs. Elsewhere (CPU) ``auto`` leaves torch's default.
- ``cudnn`` / ``flash`` / ``efficient`` / ``math``: only that torch kernel; a call it cannot
  serve fails with torch's "No available kernel" error (use ``auto`` to fall back).
- ``flash_attn``: the ``flash-attn`` extra's package (FA3's ``flash_attn_interface`` when
  present, else FA2's ``flash_attn``) for the calls it supports (CUDA, fp16/bf16, no mask, head
  dim <= 256); other calls go to torch.

Example::

    with attention_context("cudnn", torch.device("cuda")):
        loss = model(x).mean()
        loss.backward()
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# ``auto``'s preference on CUDA, fastest first (module docstring).
AUTO_ORDER = ("cudnn", "flash", "efficient", "math")
NAMES = ("auto", *BACKENDS, "flash_attn")
# ``set_priority`` (ordering, not just enabling, the backends) is newer than torch 2.5.
_HAS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def attention_context(backend: str, device: torch.device | str) -> AbstractContextManager:
    """The context to enter around forward and backward for ``backend`` on ``device``.

    Example:
        >>> q = k = v = torch.randn(1, 2, 16, 8)  # (batch, heads, tokens, head dim)
        >>> with attention_context("math", "cpu"):
        ...     out = F.scaled_dot_product_attention(q, k, v)
        >>> out.shape
        torch.Size([1, 2, 16, 8])
    """
    device = torch.device(device)
    if backend not in NAMES:
        raise ValueError(
            f"optimization.kernels.attention_backend={backend!r} is unknown; use one of "
            f"{', '.join(NAMES)}."
        )
    if backend == "auto":
        if device.type != "cuda" or not _HAS_PRIORITY:
            return nullcontext()  # torch's default order (older torch cannot reorder)
        return sdpa_kernel([BACKENDS[n] for n in AUTO_ORDER], set_priority=True)
    if backend == "flash_attn":
        return FlashAttnMode(load_flash_attn())
    return sdpa_kernel([BACKENDS[backend]])


def load_flash_attn() -> Callable[..., Any]:
    """``flash_attn_func`` of FlashAttention 3 (Hopper) or 2; ValueError with the fix if absent."""
    for module_name in ("flash_attn_interface", "flash_attn"):
        try:
            return importlib.import_module(module_name).flash_attn_func
        except (ImportError, AttributeError):
            continue
    raise ValueError(
        "optimization.kernels.attention_backend=flash_attn needs a FlashAttention package: "
        "the flash-attn extra (see docs/install.md), or use auto."
    )


class FlashAttnMode(TorchFunctionMode):
    """Routes eligible ``F.scaled_dot_product_attention`` calls to ``flash_attn_func``.

    SDPA takes ``(batch, heads, tokens, dim)``; FlashAttention takes ``(batch, tokens, heads,
    dim)``, so inputs and output are transposed (views; FlashAttention copies non-contiguous
    inputs itself when it must).
    """

    def __init__(self, flash_attn_func: Callable[..., Any], *, require_cuda: bool = True) -> None:
        super().__init__()
        self.flash_attn_func = flash_attn_func
        self.require_cuda = require_cuda  # False only in CPU tests with a stand-in function
        self.calls = 0  # how many calls went to FlashAttention (tests, logs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _flash_supports(
            self.require_cuda, *args, **kwargs
        ):
            self.calls += 1
            return self._flash(*args, **kwargs)
        return func(*args, **kwargs)

    def _flash(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        out = self.flash_attn_func(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=is_causal,
        )
        if isinstance(out, tuple):  # some FA3 releases also return the log-sum-exp
            out = out[0]
        return out.transpose(1, 2)


def _flash_supports(
    require_cuda: bool, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs
) -> bool:
    if attn_mask is not None or kwargs.get("enable_gqa"):
        return False
    tensors = (q, k, v)
    return (
        all((t.is_cuda or not require_cuda) and t.dim() == 4 for t in tensors)
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.dtype == k.dtype == v.dtype
        and q.shape[1] == k.shape[1] == v.shape[1]
        and q.shape[-1] <= 256
    )


__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "NAMES",
    "FlashAttnMode",
    "attention_context",
]
