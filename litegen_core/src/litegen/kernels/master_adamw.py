"""AdamW over FP32 master weights in one pass, one launch for all parameters (Triton, CUDA only).

``fp32_master_weights`` (:mod:`litegen.optim`) steps bf16/fp16 parameters through FP32 copies.
With torch's kernels that takes three passes over memory: the gradient upcast to FP32, torch's
fused AdamW over the masters, and the copy back into the parameter, rounded. This kernel reads
the low-precision gradient and writes the rounded parameter in the same pass that updates the
master and the moments: 28 bytes moved per parameter instead of 40. Like torch's multi-tensor
kernels, one launch steps every parameter of a device and dtype: its programs find their tensor
through a table of addresses, so a model's hundreds of small biases do not each cost a launch.

The update is torch's AdamW: decoupled weight decay, then bias-corrected moments. ``steps``
are the optimizer's per-parameter step counters (FP32 tensors on the parameter's device, as
torch's fused AdamW keeps them); they are incremented here, and the kernel reads them, so no
step count is copied to the host.

Example:
    >>> adamw_master_step(params, grads, masters, exp_avgs, exp_avg_sqs, steps,
    ...                   lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

# Elements per program, and warps per program (scripts/bench_master_adamw.py sweeps both).
_BLOCK, _NUM_WARPS = 2048, 4
_ALIGNMENT_BYTES = 16  # what the kernel tells Triton of every address, so its loads vectorize


@triton.jit
def _adamw_master_kernel(
    table_ptr,
    blocks_ptr,
    n_tensors,
    lr,
    beta1,
    beta2,
    log2_beta1,
    log2_beta2,
    one_minus_beta1,
    one_minus_beta2,
    decay,
    eps,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program i steps block blocks[i, 1] of tensor blocks[i, 0]. Column t of the table holds
    # that tensor's addresses (param, grad, master, exp_avg, exp_avg_sq, step) and its numel.
    tensor = tl.load(blocks_ptr + 2 * tl.program_id(0))
    start = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1).to(tl.int64) * BLOCK
    column = table_ptr + tensor
    numel = tl.load(column + 6 * n_tensors)
    # 16: _ALIGNMENT_BYTES, which servable() checks.
    param_ptr = tl.multiple_of(tl.load(column).to(tl.pointer_type(PARAM_DTYPE)), 16)
    grad_ptr = tl.multiple_of(tl.load(column + n_tensors).to(tl.pointer_type(GRAD_DTYPE)), 16)
    fp32 = tl.pointer_type(tl.float32)
    master_ptr = tl.multiple_of(tl.load(column + 2 * n_tensors).to(fp32), 16)
    exp_avg_ptr = tl.multiple_of(tl.load(column + 3 * n_tensors).to(fp32), 16)
    exp_avg_sq_ptr = tl.multiple_of(tl.load(column + 4 * n_tensors).to(fp32), 16)
    step_ptr = tl.load(column + 5 * n_tensors).to(fp32)
    # beta ** step as a double-precision exp2: 1 - beta2 ** step cancels most of its digits
    # early in training, so an fp32 power would show in the update.
    step = tl.load(step_ptr).to(tl.float64)
    bias_correction1 = (1.0 - tl.exp2(step * log2_beta1)).to(tl.float32)
    bias_correction2 = (1.0 - tl.exp2(step * log2_beta2)).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(bias_correction2)
    offsets = start + tl.arange(0, BLOCK)
    pointers = (param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr)
    step_size = lr / bias_correction1
    hyper = (step_size, bias_correction2_sqrt, beta1, beta2, one_minus_beta1, one_minus_beta2)
    # Only a tensor's last block needs a mask: one on the loaded numel would keep every load
    # from vectorizing.
    if start + BLOCK <= numel:
        _update(pointers, offsets, numel, hyper, decay, eps, MASKED=False)
    else:
        _update(pointers, offsets, numel, hyper, decay, eps, MASKED=True)


@triton.jit
def _update(pointers, offsets, numel, hyper, decay, eps, MASKED: tl.constexpr):
    param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr = pointers
    step_size, bias_correction2_sqrt, beta1, beta2, one_minus_beta1, one_minus_beta2 = hyper
    mask = offsets < numel if MASKED else None
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    master = tl.load(master_ptr + offsets, mask=mask)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    master = master * decay
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    master = master - step_size * exp_avg / denom
    tl.store(master_ptr + offsets, master, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    tl.store(param_ptr + offsets, master.to(param_ptr.dtype.element_ty), mask=mask)


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@functools.lru_cache(maxsize=8)
def _block_table(numels: tuple[int, ...], device: torch.device, block: int) -> torch.Tensor:
    """``(blocks, 2)`` int32 rows ``(tensor, block)``: the kernel's programs, cached per shape."""
    counts = torch.tensor([triton.cdiv(n, block) for n in numels])
    tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    index = torch.arange(len(tensor)) - first
    return torch.stack([tensor, index], dim=1).to(device=device, dtype=torch.int32)


def _launch(columns: list[list[torch.Tensor]], scalars: tuple[float, ...]) -> None:
    """One kernel over ``columns`` (the six lists, same device and dtypes), steps incremented."""
    params, grads = columns[0], columns[1]
    device = params[0].device
    numels = tuple(p.numel() for p in params)
    # The addresses change whenever a gradient is reallocated, so the table is rebuilt per step;
    # pinned and copied without blocking, so the host does not wait for the GPU.
    table = torch.tensor([[t.data_ptr() for t in c] for c in columns] + [list(numels)])
    if device.type == "cuda":
        table = table.pin_memory()
    table = table.to(device, non_blocking=True)
    blocks = _block_table(numels, device, _BLOCK)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _adamw_master_kernel[(len(blocks),)](
            table, blocks, len(params), *scalars,
            PARAM_DTYPE=_TRITON_DTYPES[params[0].dtype], GRAD_DTYPE=_TRITON_DTYPES[grads[0].dtype],
            BLOCK=_BLOCK, num_warps=_NUM_WARPS,
        )  # fmt: skip


def servable(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> bool:
    """True when the kernel can step these lists (the arguments of :func:`adamw_master_step`).

    It indexes every tensor of a parameter flat, from addresses it takes to be 16-byte aligned:
    all must be contiguous, aligned CUDA tensors of the parameter's size, the parameter and
    gradient bf16, fp16 or FP32, the master, moments and step FP32.

    Example:
        >>> servable([p], [p.grad], [master], [m], [v], [step])  # doctest: +SKIP
        True
    """
    for p, grad, *fp32, step in zip(
        params, grads, masters, exp_avgs, exp_avg_sqs, steps, strict=True
    ):
        flat = (p, grad, *fp32)
        if not all(t.is_cuda and t.is_contiguous() and t.numel() == p.numel() for t in flat):
            return False
        if any(t.data_ptr() % _ALIGNMENT_BYTES for t in flat):
            return False
        if p.dtype not in _TRITON_DTYPES or grad.dtype not in _TRITON_DTYPES:
            return False
        if not (step.is_cuda and all(t.dtype == torch.float32 for t in (*fp32, step))):
            return False
    return True


@torch.no_grad()
def adamw_master_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of ``masters`` (FP32) from low-precision ``grads``, rounded into ``params``.

    Example:
        >>> adamw_master_step([p], [p.grad], [master], [m], [v], [step], lr=1e-4,
        ...                   betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)  # doctest: +SKIP
    """
    if not servable(params, grads, masters, exp_avgs, exp_avg_sqs, steps):
        raise ValueError(
            "adamw_master_step needs contiguous, 16-byte aligned CUDA tensors of each parameter's "
            "size, with FP32 masters, moments and steps; check servable() first and use torch's "
            "AdamW otherwise."
        )
    _step_by_device_and_dtype(
        [params, grads, masters, exp_avgs, exp_avg_sqs, steps], lr, betas, eps, weight_decay
    )


def _step_by_device_and_dtype(
    columns: list[list[torch.Tensor]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`adamw_master_step` without its checks: one launch per device and dtype pair."""
    steps = columns[-1]
    torch._foreach_add_(steps, 1.0)
    # 1 - beta and 1 - lr * wd in double precision, as torch computes them: in fp32, 1 - 0.999
    # is off by 1.3e-5 (0.999 has no exact fp32 form).
    beta1, beta2 = betas
    scalars = (lr, beta1, beta2, math.log2(beta1), math.log2(beta2), 1.0 - beta1, 1.0 - beta2)
    scalars += (1.0 - lr * weight_decay, eps)
    groups: dict[tuple, list[int]] = {}
    for i, (param, grad) in enumerate(zip(columns[0], columns[1], strict=True)):
        groups.setdefault((param.device, param.dtype, grad.dtype), []).append(i)
    for indices in groups.values():
        _launch([[column[i] for i in indices] for column in columns], scalars)


__all__ = ["adamw_master_step", "servable"]
