"""AdamW over FP32 master weights in one pass per parameter (a Triton kernel, CUDA only).

``fp32_master_weights`` (:mod:`litegen.optim`) steps bf16/fp16 parameters through FP32 copies.
With torch's kernels that takes three passes over memory: the gradient upcast to FP32, torch's
fused AdamW over the masters, and the copy back into the parameter, rounded. This kernel reads
the low-precision gradient and writes the rounded parameter in the same pass that updates the
master and the moments: 28 bytes moved per parameter instead of 40.

The update is torch's AdamW: decoupled weight decay, then bias-corrected moments. ``steps``
are the optimizer's per-parameter step counters (FP32 tensors on the parameter's device, as
torch's fused AdamW keeps them); they are incremented here, and the kernel reads them, so no
step count is copied to the host.

Example:
    >>> adamw_master_step(params, grads, masters, exp_avgs, exp_avg_sqs, steps,
    ...                   lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_BLOCK = 4096


@triton.jit
def _adamw_master_kernel(
    param_ptr,
    grad_ptr,
    master_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    step_ptr,
    numel,
    lr,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    decay,
    eps,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    step = tl.load(step_ptr)
    # libdevice's pow is exact to an ulp; exp2 of a log2 would be approximate, and 1 - beta2**t
    # cancels most of its digits early in training.
    bias_correction1 = 1.0 - libdevice.pow(beta1, step)
    bias_correction2_sqrt = tl.sqrt(1.0 - libdevice.pow(beta2, step))
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    master = tl.load(master_ptr + offsets, mask=mask)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    master = master * decay
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    master = master - (lr / bias_correction1) * exp_avg / denom
    tl.store(master_ptr + offsets, master, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    tl.store(param_ptr + offsets, master.to(param_ptr.dtype.element_ty), mask=mask)


def servable(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> bool:
    """True when the kernel can step these lists (the arguments of :func:`adamw_master_step`).

    It indexes every tensor of a parameter flat: all must be contiguous CUDA tensors of the
    parameter's size, the master, moments and step FP32.

    Example:
        >>> servable([p], [p.grad], [master], [m], [v], [step])  # doctest: +SKIP
        True
    """
    for p, *others, step in zip(params, grads, masters, exp_avgs, exp_avg_sqs, steps, strict=True):
        tensors = (p, *others)
        if not all(t.is_cuda and t.is_contiguous() and t.numel() == p.numel() for t in tensors):
            return False
        fp32 = (*others[1:], step)
        if not (step.is_cuda and all(t.dtype == torch.float32 for t in fp32)):
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
            "adamw_master_step needs contiguous CUDA tensors of each parameter's size, with FP32 "
            "masters, moments and steps; check servable() first and use torch's AdamW otherwise."
        )
    torch._foreach_add_(steps, 1.0)
    # 1 - beta and 1 - lr * wd in double precision, as torch computes them: in fp32, 1 - 0.999
    # is off by 1.3e-5 (0.999 has no exact fp32 form).
    beta1, beta2 = betas
    scalars = (lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2, 1.0 - lr * weight_decay, eps)
    for param, grad, master, exp_avg, exp_avg_sq, step in zip(
        params, grads, masters, exp_avgs, exp_avg_sqs, steps, strict=True
    ):
        numel = param.numel()
        with torch.cuda.device(param.device):
            _adamw_master_kernel[(triton.cdiv(numel, _BLOCK),)](
                param, grad, master, exp_avg, exp_avg_sq, step, numel, *scalars,
                BLOCK=_BLOCK, num_warps=8,
            )  # fmt: skip


__all__ = ["adamw_master_step", "servable"]
