"""cuBLASLt GEMMs with a GELU epilogue, through ctypes (used by :mod:`litegen.experimental.fused_gelu_mlp_op`).

torch's own GEMMs reach cuBLASLt's bias and GELU epilogues (``torch._addmm_activation``) but
not the two a GELU MLP needs for training, which keep the activation out of its own kernels:

* ``GELU_AUX_BIAS``: ``h = gelu(x @ w.T + b)`` that also stores ``pre = x @ w.T + b`` (the "aux"
  output), which the backward needs;
* ``DGELU``: ``grad_pre = (grad_y @ w2) * gelu'(pre)``, the gradient through the second linear
  layer and the GELU.

Each shape's plan asks cuBLASLt's heuristic for up to 8 algorithms and, on its first call,
times them all and keeps the fastest (the heuristic's first choice measured slower for
``DGELU``; benchmarks/). Like ``torch.backends.cudnn.benchmark``, this makes the chosen
kernel, and so the last bits of the result, depend on timing.

cuBLASLt is column-major, so a row-major ``(rows, cols)`` tensor is passed as its transpose.
Both functions return ``None`` for a call cuBLASLt cannot serve (CPU, fp32, mixed dtypes,
non-contiguous or misaligned inputs, no algorithm for the shape), and the caller falls back to
torch ops. cuBLASLt's GELU is the tanh approximation.

Example::

    pre, h = gelu_aux_bias(x, w1, b1)
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

_OP_N, _OP_T = 0, 1
_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4
_EPILOGUE_DGELU = 64 | 128
# cublasLtMatmulDescAttributes_t
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER, _AUX_POINTER, _AUX_LD = 3, 4, 7, 8, 11, 12
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT_A_BYTES, _PREF_MIN_ALIGNMENT_B_BYTES = 5, 6
_COMPUTE_32F, _R_32F = 68, 0
_STATUS_NOT_SUPPORTED = 15
_DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2}
_WORKSPACE_BYTES = 32 * 2**20
# Algorithms asked of the heuristic per plan; all are timed on the first call, 10 runs each
# (fewer runs let timing noise keep a slower candidate).
_CANDIDATES, _TIMED_RUNS = 8, 10


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@functools.cache
def _library() -> ctypes.CDLL:
    """The libcublasLt torch already loaded (its exact build), found in this process's maps."""
    torch.cuda.current_blas_handle()  # loads cuBLAS, and with it cuBLASLt
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = line.split()[-1]
            if "libcublasLt.so" in path:
                return ctypes.CDLL(path)
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("libcublasLt is not loaded in this process")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device_index: int, stream: int) -> torch.Tensor:
    # One per stream, as torch keeps its own: GEMMs on two streams must not share scratch space.
    return torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def _set(desc: ctypes.c_void_p, attribute: int, value: ctypes._SimpleCData) -> None:
    lib = _library()
    status = lib.cublasLtMatmulDescSetAttribute(
        desc, attribute, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))
    )
    _check(status, f"cublasLtMatmulDescSetAttribute({attribute})")


class _Plan:
    """Descriptors and candidate algorithms for one GEMM shape and epilogue (built once).

    ``algo`` is the candidate chosen on the first call (:func:`_matmul` times them all).
    """

    def __init__(self, key: tuple) -> None:
        device_index, dtype, epilogue, transa, m, n, k, lda, ldb, ldd, align_a, align_b = key
        lib = _library()
        data_type = _DATA_TYPES[dtype]
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        _set(self.desc, _TRANSA, ctypes.c_int32(transa))
        _set(self.desc, _TRANSB, ctypes.c_int32(_OP_N))
        _set(self.desc, _EPILOGUE, ctypes.c_uint32(epilogue))
        _set(self.desc, _AUX_LD, ctypes.c_int64(ldd))
        rows_a, cols_a = (k, m) if transa == _OP_T else (m, k)
        self.layouts = [ctypes.c_void_p() for _ in range(3)]
        for layout, (rows, cols, ld) in zip(
            self.layouts, ((rows_a, cols_a, lda), (k, n, ldb), (m, n, ldd)), strict=True
        ):
            # rows and cols are uint64_t and ld int64_t in the C API: sized explicitly for ctypes.
            status = lib.cublasLtMatrixLayoutCreate(
                ctypes.byref(layout), data_type, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                ctypes.c_int64(ld),
            )  # fmt: skip
            _check(status, "cublasLtMatrixLayoutCreate")
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        # Inputs may be views at any offset (FSDP's gathered parameters): tell the heuristic
        # their real alignment, which it otherwise assumes to be 256 bytes. D, the aux matrix
        # and the bias are LiteGen's own allocations, aligned to 256.
        for attribute, value in (
            (_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(_WORKSPACE_BYTES)),
            (_PREF_MIN_ALIGNMENT_A_BYTES, ctypes.c_uint32(align_a)),
            (_PREF_MIN_ALIGNMENT_B_BYTES, ctypes.c_uint32(align_b)),
        ):
            status = lib.cublasLtMatmulPreferenceSetAttribute(
                pref, attribute, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))
            )
            _check(status, f"cublasLtMatmulPreferenceSetAttribute({attribute})")
        self.results = (_HeuristicResult * _CANDIDATES)()
        found = ctypes.c_int(0)
        a, b, d = self.layouts
        status = lib.cublasLtMatmulAlgoGetHeuristic(
            _handle(device_index), self.desc, a, b, d, d, pref, _CANDIDATES,
            self.results, ctypes.byref(found),
        )  # fmt: skip
        lib.cublasLtMatmulPreferenceDestroy(pref)
        count = found.value if status == 0 else 0
        self.candidates = [self.results[i] for i in range(count) if self.results[i].state == 0]
        self.usable = bool(self.candidates)
        self.algo: _HeuristicResult | None = None
        # The bias and aux pointers live in the shared descriptor: one call at a time sets
        # them and launches (autograd's backward thread and the forward's may share a plan).
        self.lock = threading.Lock()

    def __del__(self) -> None:  # evicted from the plan cache
        try:
            lib = _library()
            for layout in self.layouts:
                lib.cublasLtMatrixLayoutDestroy(layout)
            lib.cublasLtMatmulDescDestroy(self.desc)
        except Exception:  # a half-built plan, or the library already unloaded
            pass


# Bounded: each new token count (resolution, batch size) is a new shape.
@functools.lru_cache(maxsize=256)
def _plan(key: tuple) -> _Plan:
    return _Plan(key)


def servable(*tensors: torch.Tensor) -> bool:
    """Whether epilogue GEMMs can read these tensors: CUDA, one of bf16/fp16, 16-byte rows.

    cuBLASLt reads rows as laid out (contiguous, one dtype) and its epilogues want 16-byte
    aligned rows: bf16/fp16 dims that are multiples of 8.

    Example:
        >>> servable(torch.ones(4, 8))  # fp32 on CPU
        False
    """
    dtype = tensors[0].dtype
    return dtype in _DATA_TYPES and all(
        t.is_cuda and t.dtype == dtype and t.is_contiguous() and t.shape[-1] % 8 == 0
        for t in tensors
    )


def _alignment(tensor: torch.Tensor) -> int:
    """The largest power of two (up to 256) that divides the tensor's address, in bytes."""
    address = tensor.data_ptr()
    return min(256, address & -address) if address else 256


def _matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    *,
    transa: int,
    m: int,
    n: int,
    k: int,
    epilogue: int,
    bias: torch.Tensor | None,
    aux: torch.Tensor,
) -> bool:
    """``d = epilogue(op(a) @ b)`` in cuBLASLt's column-major terms; False if unsupported."""
    device_index = d.device.index if d.device.index is not None else torch.cuda.current_device()
    align_a, align_b = _alignment(a), _alignment(b)
    if min(align_a, align_b) < 16:
        return False
    shape = (m, n, k, a.shape[-1], b.shape[-1], d.shape[-1])
    key = (device_index, d.dtype, epilogue, transa, *shape, align_a, align_b)
    plan = _plan(key)
    if not plan.usable:
        return False
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    layout_a, layout_b, layout_d = plan.layouts
    stream = torch.cuda.current_stream(d.device).cuda_stream
    workspace = _workspace(device_index, stream).data_ptr()

    def launch(result: _HeuristicResult) -> int:
        return _library().cublasLtMatmul(
            _handle(device_index), plan.desc, ctypes.byref(alpha),
            ctypes.c_void_p(a.data_ptr()), layout_a, ctypes.c_void_p(b.data_ptr()), layout_b,
            ctypes.byref(beta), ctypes.c_void_p(d.data_ptr()), layout_d,
            ctypes.c_void_p(d.data_ptr()), layout_d, ctypes.byref(result.algo),
            ctypes.c_void_p(workspace), ctypes.c_size_t(_WORKSPACE_BYTES),
            ctypes.c_void_p(stream),
        )  # fmt: skip

    with plan.lock:
        if bias is not None:
            _set(plan.desc, _BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        _set(plan.desc, _AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))
        if plan.algo is None:
            with torch.cuda.device(d.device):  # events and the capture check: d's stream
                plan.algo = _fastest(plan.candidates, launch)
        status = launch(plan.algo)
    if status == _STATUS_NOT_SUPPORTED:
        return False
    _check(status, "cublasLtMatmul")
    return True


def _fastest(candidates: list[_HeuristicResult], launch) -> _HeuristicResult:
    """The candidate that runs this call fastest (timed over a few runs, after a warm-up run).

    The heuristic's first choice is not always the fastest for epilogue GEMMs. Timing needs a
    synchronisation, so it happens once per plan, and never while a CUDA graph is captured.
    """
    if len(candidates) == 1 or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    best, best_ms = candidates[0], float("inf")
    for candidate in candidates:
        if launch(candidate) != 0:  # warm-up; a candidate that fails is skipped
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(_TIMED_RUNS):
            launch(candidate)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) < best_ms:
            best, best_ms = candidate, start.elapsed_time(end)
    return best


def gelu_aux_bias(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(pre, gelu(pre))`` with ``pre = x @ weight.T + bias`` in one GEMM; 2-D contiguous inputs.

    Example::

        pre, h = gelu_aux_bias(x, fc1.weight, fc1.bias)
    """
    if not servable(x, weight, bias):
        return None
    n, k = x.shape
    m = weight.shape[0]
    if _alignment(bias) < 256:  # a parameter view; the heuristic assumed 256 (see _Plan)
        bias = bias.clone()
    pre = x.new_empty(n, m)
    h = x.new_empty(n, m)
    # Column-major: h.T (m x n) = weight (k x m stored, transposed) @ x.T (k x n).
    done = _matmul(
        weight, x, h, transa=_OP_T, m=m, n=n, k=k, epilogue=_EPILOGUE_GELU_AUX_BIAS,
        bias=bias, aux=pre,
    )  # fmt: skip
    return (pre, h) if done else None


def dgelu(grad_y: torch.Tensor, weight: torch.Tensor, pre: torch.Tensor) -> torch.Tensor | None:
    """``(grad_y @ weight) * gelu'(pre)`` in one GEMM; ``weight`` is the second linear's.

    ``pre`` is the aux output of :func:`gelu_aux_bias`.

    Example::

        grad_pre = dgelu(grad_y, fc2.weight, pre)
    """
    if not servable(grad_y, weight, pre):
        return None
    n, k = grad_y.shape
    m = weight.shape[1]
    grad_pre = grad_y.new_empty(n, m)
    done = _matmul(
        weight, grad_y, grad_pre, transa=_OP_N, m=m, n=n, k=k, epilogue=_EPILOGUE_DGELU,
        bias=None, aux=pre,
    )  # fmt: skip
    return grad_pre if done else None


__all__ = ["dgelu", "gelu_aux_bias", "servable"]
