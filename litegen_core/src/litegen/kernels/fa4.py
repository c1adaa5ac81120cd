"""FlashAttention 4 as the kernels behind torch's flash SDPA backend (``attention_backend: flash_attn``).

FA4 is the ``flash-attn-4`` package (the ``flash-attn-4`` extra): CuTe DSL kernels for Hopper and
Blackwell, compiled just in time on first use for each shape family. :func:`register` makes them
the CUDA implementation of ``aten::_scaled_dot_product_flash_attention`` and of its backward, the
two ops torch's flash backend calls. So models keep calling ``F.scaled_dot_product_attention``,
``sdpa_kernel`` selects FA4 like any backend, and autograd and ``torch.compile`` see the same aten
ops as before, with their meta kernels. torch 2.11 has a prototype of the same idea
(``torch.nn.attention.activate_flash_attention_impl("FA4")``); it expects FA4's forward to return
two values and fails on current FA4 releases, which return five.

FA4 4.0.0b36 computes dq wrong on Hopper at head dims that are not multiples of 32 (such as the
benchmark DiTs' 72); :func:`interface` fixes that in FA4's module when it loads it
(:func:`_match_dq_accumulator_to_kernel`). LiteGen calls FA4's private functions, so it accepts
only the release it was tested with, :data:`FA4_VERSION` (the extra pins it). On Hopper, the
forward of sequences up to :data:`CUDNN_FORWARD_MAX_TOKENS` runs on cuDNN's kernel, faster there,
with FA4's backward (:func:`_forward_on_cudnn`); with cuDNN off, short sequences get smaller
forward tiles than FA4's default (:func:`_forward_tile`).

Outputs are allocated the way the ops' meta kernels allocate them (``torch.empty_like`` of the
input): compiled graphs assert those strides. For a model that splits a fused qkv projection,
that is FA4's own layout, (batch, tokens, heads, dim) in memory, so FA4 writes the output in
place and the model's reshape after attention copies nothing.

Example:
    >>> if register():  # False without the package
    ...     with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    ...         out = F.scaled_dot_product_attention(q, k, v)  # FA4's kernels
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from types import ModuleType

import torch

FA4_MODULE = "flash_attn.cute.interface"
FA4_VERSION = "4.0.0b36"  # the flash-attn-4 release LiteGen's FA4 path is tested with
_library: torch.library.Library | None = None  # kept alive: dropping it unregisters the kernels


def register() -> bool:
    """Route torch's flash SDPA ops on CUDA to FA4; True once they are, False without FA4."""
    global _library
    if _library is None:
        try:
            interface()
        except ImportError:
            return False
        library = torch.library.Library("aten", "IMPL")
        library.impl("_scaled_dot_product_flash_attention", forward, "CUDA")
        library.impl("_scaled_dot_product_flash_attention_backward", backward, "CUDA")
        _library = library
    return True


@functools.cache
def interface() -> ModuleType:
    """FA4's interface module, with its Hopper dq fixed (ImportError without the tested FA4)."""
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError("flash-attn-4 is not installed") from err
    if version != FA4_VERSION:
        raise ImportError(
            f"LiteGen's FA4 path is tested with flash-attn-4=={FA4_VERSION} and found {version}; "
            "install the tested release with `uv sync --all-packages --extra flash-attn-4`"
        )
    module = importlib.import_module(FA4_MODULE)
    if not hasattr(module, "_flash_attn_fwd") or not hasattr(module, "_flash_attn_bwd"):
        raise ImportError(f"{FA4_MODULE} has no _flash_attn_fwd/_flash_attn_bwd")
    _match_dq_accumulator_to_kernel(module)
    return module


def _match_dq_accumulator_to_kernel(module: ModuleType) -> None:
    """Make FA4's backward postprocess read dq's accumulator the way its Hopper kernel writes it.

    FA4's backward accumulates dq in FP32, tile by tile, into a buffer that a postprocess kernel
    converts to dq. Its Hopper (SM90) backward kernel lays the tiles out by the head dim rounded
    up to 16 (``flash_bwd_sm90.py``), while ``_flash_attn_bwd`` tells the postprocess to round it
    up to 32 (``hdim_multiple_of``). At head dim 72 the kernel writes rows of 80 that the
    postprocess reads as rows of 96: dq was off by up to 0.9 on H200, while the output, dk and
    dv were right; at multiples of 32 the two agree. The preprocess, which zeroes the buffer
    (sized for the 32 rounding, so it holds the kernel's layout), keeps FA4's 32: given 16 it
    made every gradient wrong at head dim 72. Blackwell's kernel rounds to 32, and Hopper's
    swapped-operand configuration (``dKV_swapAB``) passes 64, so only Hopper's 32 becomes 16.
    FA4's module is changed in place, for every caller in the process.
    """
    original = module._bwd_postprocess_convert
    if hasattr(original, "__wrapped__"):
        return  # already matched (interface() was loaded again)
    device_arch = module._get_device_arch  # cached by FA4

    # functools.wraps also carries over the kernel cache FA4 keeps on the function.
    @functools.wraps(original)
    def with_kernel_rounding(*args, hdim_multiple_of=32, **kwargs):
        if hdim_multiple_of == 32 and device_arch() // 10 == 9:
            hdim_multiple_of = 16
        return original(*args, hdim_multiple_of=hdim_multiple_of, **kwargs)

    module._bwd_postprocess_convert = with_kernel_rounding


def forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple:
    """``aten::_scaled_dot_product_flash_attention`` on FA4; inputs are (batch, heads, tokens, dim)."""
    if dropout_p != 0.0 or return_debug_mask:
        raise RuntimeError(
            "FA4 attention has no dropout or debug mask; set attention dropout to 0 or use "
            "optimization.kernels.attention_backend=auto"
        )
    module = interface()
    arch = module._get_device_arch()
    if _forward_on_cudnn(query, key, is_causal, arch):
        out, lse = _cudnn_forward(query, key, value, is_causal, scale)
    else:
        out = torch.empty_like(query)
        _, lse, *_ = module._flash_attn_fwd(
            *_bshd(query, key, value),
            softmax_scale=scale,
            causal=is_causal,
            return_lse=True,
            out=out.transpose(1, 2),
            tile_mn=_forward_tile(query, key, is_causal, arch),
        )
    device = query.device
    return (
        out,
        lse.contiguous(),
        None,
        None,
        query.size(2),
        key.size(2),
        torch.zeros(2, dtype=torch.uint64, device=device),  # no dropout, so no RNG state
        torch.zeros((), dtype=torch.uint64, device=device),
        torch.empty(0, dtype=query.dtype, device=device),
    )


# The longest sequence whose forward runs on cuDNN on Hopper (see _forward_on_cudnn).
CUDNN_FORWARD_MAX_TOKENS = 1024


def _forward_on_cudnn(query: torch.Tensor, key: torch.Tensor, is_causal: bool, arch: int) -> bool:
    """Whether cuDNN's forward kernel serves this call instead of FA4's: short sequences on Hopper.

    On H200, cuDNN's forward measured faster than FA4's up to 1024 tokens (head dim 72: 0.150 ms
    against 0.203 at workload C's 256 tokens, 0.437 against 0.512 at 1024) and slower from 2048
    on, at head dims 64, 72 and 128 (``docs/benchmarks.md``). Its log-sum-exp is FA4's, so
    FA4's backward takes cuDNN's output and gives the same gradients. Causal attention was not
    measured and stays on FA4.
    """
    return (
        not is_causal
        and arch // 10 == 9
        and max(query.size(2), key.size(2)) <= CUDNN_FORWARD_MAX_TOKENS
        and query.size(-1) <= 128
        and query.size(-1) % 8 == 0
        and torch.backends.cudnn.is_available()
        and torch.backends.cudnn.enabled
    )


def _cudnn_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's attention output and its log-sum-exp in FA4's (batch, heads, tokens) shape."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, is_causal, False, scale=scale
    )[:2]
    # Compiled graphs assert the meta kernel's strides, empty_like(query)'s. cuDNN allocates in
    # the query's layout as well; should a release not, the output is copied into that layout.
    if out.stride() != torch.empty_like(query, device="meta").stride():
        out = torch.empty_like(query).copy_(out)
    return out, lse.reshape(query.shape[:-1])


def _forward_tile(
    query: torch.Tensor, key: torch.Tensor, is_causal: bool, arch: int
) -> tuple[int, int] | None:
    """128 x 128 forward tiles where FA4's Hopper default would pad the sequences by far more.

    For head dims 65-96, FA4's Hopper forward takes tiles of 192 queries by 144 keys, its
    fastest for long sequences. At 256 tokens (workload C) they pad the work to 384 x 288,
    1.7 times the real 256 x 256, which 128 x 128 tiles cover exactly: the forward kernel took
    0.203 ms instead of 0.269 on H200 (``docs/benchmarks.md``). Such short sequences run on
    cuDNN (:func:`_forward_on_cudnn`) unless cuDNN is off. ``arch`` is FA4's own (90 on
    Hopper), which picks its kernels. ``None`` keeps FA4's choice.
    """
    if is_causal or not 64 < query.size(-1) <= 96 or arch // 10 != 9:
        return None
    queries, keys = query.size(2), key.size(2)
    default = _round_up(queries, 192) * _round_up(keys, 144)
    return (128, 128) if _round_up(queries, 128) * _round_up(keys, 128) < 0.8 * default else None


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten::_scaled_dot_product_flash_attention_backward`` on FA4."""
    grads = tuple(torch.empty_like(t) for t in (query, key, value))
    backward_into(grads, grad_out, query, key, value, out, logsumexp, is_causal, scale)
    return grads


def backward_into(
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> None:
    """FA4's dq, dk, dv of (batch, heads, tokens, dim) inputs, written into ``grads``.

    FA4 writes the gradients straight into ``grads``, whatever their strides (last one 1): the
    aten op's meta layout, or slices of one packed buffer (:mod:`litegen.kernels.packed_qkv`).
    """
    dq, dk, dv = _bshd(*grads)
    interface()._flash_attn_bwd(
        *_bshd(query, key, value, out, grad_out),
        logsumexp.contiguous(),
        softmax_scale=scale,
        causal=is_causal,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        dq=dq,
        dk=dk,
        dv=dv,
    )


def _bshd(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(batch, heads, tokens, dim) views as FA4's (batch, tokens, heads, dim)."""
    return tuple(t.transpose(1, 2) for t in tensors)


__all__ = [
    "CUDNN_FORWARD_MAX_TOKENS",
    "FA4_MODULE",
    "FA4_VERSION",
    "backward",
    "backward_into",
    "forward",
    "interface",
    "register",
]
