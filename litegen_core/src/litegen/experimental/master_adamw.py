"""AdamW over FP32 master weights in one pass, one launch for all parameters (Triton, CUDA only).

``fp32_master_weights`` (:mod:`litegen.optim`) steps bf16/fp16 parameters through FP32 copies.
With torch's kernels that takes three passes over memory: the gradient upcast to FP32, torch's
fused AdamW over the masters, and the copy back into the parameter, rounded. This kernel reads
the low-precision gradient and writes the rounded parameter in the same pass that updates the
master and the moments: 28 bytes moved per parameter instead of 40. Like torch's multi-tensor
kernels, one launch steps every parameter of a device and dtype (tensors off a 16-byte boundary
get a second one): its programs find their tensor through a table of addresses, so a model's
hundreds of small biases do not each cost a launch.

The update is torch's AdamW: decoupled weight decay, then bias-corrected moments. ``steps``
are the optimizer's per-parameter step counters (FP32 tensors on the parameter's device, as
torch's fused AdamW keeps them); they are incremented here, and the kernel reads them, so no
step count is copied to the host.

Example::

    adamw_master_step(params, grads, masters, exp_avgs, exp_avg_sqs, steps,
                      lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

# Elements per program, and warps per program (scripts/lab/bench_master_adamw.py sweeps both).
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
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program i steps block blocks[i, 1] of tensor blocks[i, 0]. Column t of the table holds
    # that tensor's addresses (param, grad, master, exp_avg, exp_avg_sq, step) and its numel.
    tensor = tl.load(blocks_ptr + 2 * tl.program_id(0))
    start = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1).to(tl.int64) * BLOCK
    column = table_ptr + tensor
    numel = tl.load(column + 6 * n_tensors)
    param_ptr = _pointer(column, PARAM_DTYPE, ALIGNED)
    grad_ptr = _pointer(column + n_tensors, GRAD_DTYPE, ALIGNED)
    master_ptr = _pointer(column + 2 * n_tensors, tl.float32, ALIGNED)
    exp_avg_ptr = _pointer(column + 3 * n_tensors, tl.float32, ALIGNED)
    exp_avg_sq_ptr = _pointer(column + 4 * n_tensors, tl.float32, ALIGNED)
    fp32 = tl.pointer_type(tl.float32)
    step_ptr = tl.load(column + 5 * n_tensors).to(fp32)
    # beta ** step as an exp2 in double precision (of log2(beta) rounded to fp32, as Triton
    # passes floats): 1 - beta2 ** step cancels most of its digits early in training, so an
    # fp32 power would show in the update.
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
def _pointer(address_ptr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The pointer stored at ``address_ptr``; ALIGNED: every tensor of the launch is 16-byte
    aligned (_ALIGNMENT_BYTES), which lets the loads and stores vectorize."""
    pointer = tl.load(address_ptr).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


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


@functools.lru_cache(maxsize=64)  # one per optimizer group, dtype and device: a few, mostly
def _block_table(numels: tuple[int, ...], device: torch.device, block: int) -> torch.Tensor:
    """``(blocks, 2)`` int32 rows ``(tensor, block)``: the kernel's programs, cached per shape."""
    counts = torch.tensor([triton.cdiv(n, block) for n in numels])
    tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    index = torch.arange(len(tensor)) - first
    return _to_device(torch.stack([tensor, index], dim=1).to(torch.int32), device)


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned, and copied without blocking, so the host does not wait for the GPU."""
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True)


def _launch(columns: list[list[torch.Tensor]], scalars: tuple[float, ...], aligned: bool) -> None:
    """One kernel over ``columns``: the six lists, of one device and dtypes, with the steps
    already incremented; ``aligned``: every address but the steps' is 16-byte aligned."""
    params, grads = columns[0], columns[1]
    device = params[0].device
    numels = tuple(p.numel() for p in params)
    # The addresses change whenever a gradient is reallocated, so the table is rebuilt per step.
    table = [[t.data_ptr() for t in column] for column in columns] + [list(numels)]
    table = _to_device(torch.tensor(table), device)
    blocks = _block_table(numels, device, _BLOCK)
    if not len(blocks):  # only empty tensors: a launch of no programs is a CUDA error
        return
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _adamw_master_kernel[(len(blocks),)](
            table, blocks, len(params), *scalars,
            PARAM_DTYPE=_TRITON_DTYPES[params[0].dtype], GRAD_DTYPE=_TRITON_DTYPES[grads[0].dtype],
            ALIGNED=aligned, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
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

    It indexes every tensor of a parameter flat: all must be contiguous tensors of the
    parameter's size on its CUDA device, the parameter and gradient bf16, fp16 or FP32, the
    master, moments and step FP32.

    Example::

        servable([p], [p.grad], [master], [m], [v], [step])
    """
    for p, grad, *fp32, step in zip(
        params, grads, masters, exp_avgs, exp_avg_sqs, steps, strict=True
    ):
        flat = (p, grad, *fp32)
        if not all(t.is_contiguous() and t.numel() == p.numel() for t in flat):
            return False
        if not (p.is_cuda and all(t.device == p.device for t in (*flat, step))):
            return False
        if p.dtype not in _TRITON_DTYPES or grad.dtype not in _TRITON_DTYPES:
            return False
        if not all(t.dtype == torch.float32 for t in (*fp32, step)):
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

    Example::

        adamw_master_step([p], [p.grad], [master], [m], [v], [step], lr=1e-4,
                          betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    """
    if not servable(params, grads, masters, exp_avgs, exp_avg_sqs, steps):
        raise ValueError(
            "adamw_master_step needs contiguous tensors of each parameter's size on its CUDA "
            "device, with FP32 masters, moments and steps; check servable() first and use "
            "torch's AdamW otherwise."
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
    """:func:`adamw_master_step` without its checks: one launch per device, dtypes, alignment."""
    steps = columns[-1]
    torch._foreach_add_(steps, 1.0)
    # 1 - beta and 1 - lr * wd in double precision, as torch computes them: in fp32, 1 - 0.999
    # is off by 1.3e-5 (0.999 has no exact fp32 form).
    beta1, beta2 = betas
    log2_beta1, log2_beta2 = (math.log2(b) if b > 0 else -math.inf for b in betas)  # 0 ** step
    scalars = (lr, beta1, beta2, log2_beta1, log2_beta2, 1.0 - beta1, 1.0 - beta2)
    scalars += (1.0 - lr * weight_decay, eps)
    groups: dict[tuple, list[int]] = {}
    for i, (param, grad) in enumerate(zip(columns[0], columns[1], strict=True)):
        # A tensor off a 16-byte boundary (a gradient in a DDP bucket after an odd-sized one)
        # gets a launch of its own kind, so the aligned rest keeps its vectorized loads.
        aligned = not any(column[i].data_ptr() % _ALIGNMENT_BYTES for column in columns[:5])
        groups.setdefault((param.device, param.dtype, grad.dtype, aligned), []).append(i)
    for (*_, aligned), indices in groups.items():
        _launch([[column[i] for i in indices] for column in columns], scalars, aligned)


__all__ = ["adamw_master_step", "servable"]


def one_pass_step(hyper: dict, *tensor_lists: list[torch.Tensor]) -> bool:
    """:data:`litegen.optim.MasterStepKernel`: this kernel where it serves the group, else False.

    Example::

        set_master_step_kernel(optimizer, one_pass_step)
    """
    numbers = (hyper["lr"], *hyper["betas"], hyper["eps"], hyper["weight_decay"])
    if not all(isinstance(v, int | float) for v in numbers):  # e.g. a tensor learning rate
        return False
    if not servable(*tensor_lists):
        return False
    adamw_master_step(*tensor_lists, **hyper)
    return True
