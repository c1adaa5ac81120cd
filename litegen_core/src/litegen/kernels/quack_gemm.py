"""quack's GEMM with a GELU epilogue, the fused GELU MLP's forward where quack is installed.

quack (``quack-kernels``, installed with the ``flash-attn-4`` extra) has CuTe DSL GEMMs for
Hopper and Blackwell whose epilogue applies an activation and also stores the pre-activation,
what :func:`litegen.kernels.cublaslt.gelu_aux_bias` does with cuBLASLt. Its GELU uses the GPU's
fast ``tanh`` instruction. On H200 at workloads A and C's MLP shape (32768 tokens, 1152 -> 4608)
it took 0.556 ms and 383 mJ a call under sustained load, against cuBLASLt's 0.674 ms and 462 mJ,
with the same errors against FP32 (``docs/benchmarks.md``). The energy is what counts: a
training step at full speed holds an H200 at its power limit, so a step takes as long as its
energy takes at that limit (``scripts/gpu_power.py``). quack's backward epilogue was no better
than cuBLASLt's ``DGELU`` (466 against 455 mJ), so the backward stays with cuBLASLt.

quack compiles a kernel on the first call of each shape family (about 4 s); ``tuned=False``
takes its default configuration, which measured as fast as its autotuned one here and skips
the 100 s of tuning. :func:`gelu_aux_bias` returns ``None`` wherever quack cannot serve the
call (no quack, before Hopper, fp32, non-contiguous or misaligned inputs), and the caller falls
back to cuBLASLt. If quack fails to build its kernel (quack 0.6.5 fingerprints its epilogue
through the DSL's own functions unless they are installed under ``site-packages``), LiteGen logs
the error once and stays with cuBLASLt for the rest of the process. Set ``ENABLED = False`` for
cuBLASLt everywhere (``bench_gelu_mlp.py`` times both).

Example:
    >>> pre, h = gelu_aux_bias(x, fc1.weight, fc1.bias)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from litegen.kernels import cublaslt

# False: every call returns None, so the fused MLP runs cuBLASLt's epilogue.
ENABLED = True
# Why quack failed in this process, after which it is not called again (gelu_aux_bias).
_failure: str | None = None
log = logging.getLogger("litegen")


@functools.cache
def _gemm_act() -> Callable | None:
    try:
        from quack.gemm_interface import gemm_act
    except ImportError:  # not installed, or built for another CUDA
        return None
    return gemm_act


def gelu_aux_bias(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(pre, gelu_tanh(pre))`` with ``pre = x @ weight.T + bias`` in one quack GEMM, or None.

    Example:
        >>> pre, h = gelu_aux_bias(x, fc1.weight, fc1.bias)  # doctest: +SKIP
    """
    global _failure
    if not ENABLED or _failure is not None or not _servable(x, weight, bias):
        return None
    gemm_act = _gemm_act()
    if gemm_act is None:
        return None
    try:
        pre, h = gemm_act(x, weight.t(), bias=bias, activation="gelu_tanh_approx", tuned=False)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # quack could not build its kernel here: fall back, once, loudly
        _failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log.warning("quack's GELU GEMM failed (%s); using cuBLASLt's from now on", _failure)
        return None
    return pre, h


def _servable(*tensors: torch.Tensor) -> bool:
    # cuBLASLt's conditions, on Hopper or newer, with 16-byte aligned bases for TMA's loads.
    return (
        cublaslt.servable(*tensors)
        and torch.cuda.get_device_capability(tensors[0].device)[0] >= 9
        and all(t.data_ptr() % 16 == 0 for t in tensors)
    )


__all__ = ["ENABLED", "gelu_aux_bias"]
