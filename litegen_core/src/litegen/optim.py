"""Optimizer settings LiteGen applies to the user's optimizer (``optimization.optimizer``).

* ``backend``: which torch implementation steps the parameters: ``single_tensor`` (a loop over
  tensors), ``foreach`` (multi-tensor kernels) or ``fused`` (one kernel, CUDA only).
* ``fp32_master_weights``: AdamW keeps an FP32 copy of every bf16/fp16 parameter in its state
  (``state[p]["master"]``, with FP32 moments beside it), steps that copy with the gradient
  upcast to FP32, and writes the result back into the parameter rounded to nearest. Small
  updates that would vanish in bf16 accumulate in the master instead. Torch's AdamW steps the
  masters, unless a kernel that does the whole update in one pass is set for the optimizer
  (:func:`set_master_step_kernel`; ``optimization.experimental.master_adamw`` sets one).

The master step runs in an optimizer *step pre-hook*: it updates the low-precision parameters
itself and hides their gradients, so the optimizer's own step only touches FP32 parameters. The
optimizer object, its ``param_groups`` (which keep referencing the model's parameters, so
``get_optimizer_state_dict`` maps state by parameter identity) and LR schedulers built on it
are untouched. DTensor parameters (FSDP2 shards) are stepped through ``to_local()``, and their
state is kept as DTensors with the parameter's placements, so it reshards like torch's own.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.adam import adam

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Optimizers whose constructor takes the foreach/fused flags this module sets.
_BACKEND_AWARE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_MOMENTS = ("exp_avg", "exp_avg_sq")


def configure_optimizer(
    optimizer: torch.optim.Optimizer,
    settings: Any,
    *,
    master_weights: bool = True,
    strategy: str = "this strategy",
) -> torch.optim.Optimizer:
    """Apply ``optimization.optimizer`` (an ``OptimizerConfig``) to ``optimizer`` in place.

    ``master_weights=False`` is for strategies without master-weight support: a requested
    ``fp32_master_weights`` is then ignored with a warning naming ``strategy``.

    Example:
        >>> from litegen.config.sections import OptimizerConfig
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = configure_optimizer(torch.optim.AdamW(model.parameters()), OptimizerConfig())
    """
    apply_backend(optimizer, settings)
    if settings.fp32_master_weights:
        if master_weights:
            enable_master_weights(optimizer)
        else:
            warnings.warn(
                f"optimization.optimizer.fp32_master_weights is not applied by {strategy}; it is "
                "ignored (see docs/strategies.md for the strategies that keep FP32 masters).",
                stacklevel=2,
            )
    return optimizer


def apply_backend(optimizer: torch.optim.Optimizer, settings: Any) -> None:
    """Apply ``settings.backend`` (an ``OptimizerConfig``'s) only when the config sets one.

    A backend left null keeps the optimizer's own foreach/fused choice, so
    AdamW(fused=True) stays fused; a backend written in the config overrides it.

    Example:
        >>> from litegen.config.sections import OptimizerConfig
        >>> opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), foreach=False)
        >>> apply_backend(opt, OptimizerConfig(backend="foreach"))
        >>> opt.param_groups[0]["foreach"]
        True
    """
    if settings.backend is not None:
        set_backend(optimizer, settings.backend)


def set_backend(optimizer: torch.optim.Optimizer, backend: str) -> None:
    """Set the ``foreach``/``fused`` flags of every param group (and the defaults).

    Example:
        >>> opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
        >>> set_backend(opt, "foreach")
        >>> opt.param_groups[0]["foreach"]
        True
    """
    flags = {
        "single_tensor": {"foreach": False, "fused": None},
        "foreach": {"foreach": True, "fused": None},
        "fused": {"foreach": False, "fused": True},
    }
    if backend not in flags:
        raise ValueError(
            f"optimization.optimizer.backend must be one of {sorted(flags)}, got {backend!r}."
        )
    if not isinstance(optimizer, _BACKEND_AWARE):
        if backend != "single_tensor":
            raise ValueError(
                f"optimization.optimizer.backend {backend!r} applies to Adam, AdamW and SGD, not "
                f"{type(optimizer).__name__}; set backend: single_tensor."
            )
        return  # other optimizers keep their own implementation choice
    if backend == "fused":
        devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
        if devices != {"cuda"}:
            raise ValueError(
                "optimization.optimizer.backend 'fused' needs every parameter on CUDA, but "
                f"found {sorted(devices)}; use backend: foreach (or single_tensor) on the CPU."
            )
    for target in (optimizer.defaults, *optimizer.param_groups):
        target.update(flags[backend])


def enable_master_weights(optimizer: torch.optim.Optimizer) -> None:
    """Step bf16/fp16 parameters of an AdamW through FP32 master copies (see module docs).

    Idempotent; a no-op when every parameter is already FP32.

    Example:
        >>> bf16_model = torch.nn.Linear(4, 4).to(torch.bfloat16)
        >>> optimizer = torch.optim.AdamW(bf16_model.parameters())
        >>> enable_master_weights(optimizer)
        >>> bf16_model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
        >>> optimizer.step()
        >>> optimizer.state[bf16_model.weight]["master"].dtype
        torch.float32
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(p.dtype in _LOW_PRECISION for p in params):
        return
    if getattr(optimizer, "_litegen_master_weights", False):
        return
    if not isinstance(optimizer, torch.optim.Adam) or not optimizer.defaults.get(
        "decoupled_weight_decay", False
    ):
        raise ValueError(
            f"optimization.optimizer.fp32_master_weights supports AdamW only, got "
            f"{type(optimizer).__name__}; use torch.optim.AdamW or set "
            "fp32_master_weights: false."
        )
    optimizer.register_step_pre_hook(_master_step)
    optimizer.register_step_post_hook(_restore_grads)
    optimizer.register_load_state_dict_pre_hook(_keep_fp32_state)
    optimizer.register_load_state_dict_post_hook(_restore_fp32_state)
    optimizer._litegen_master_weights = True
    optimizer._litegen_hidden_grads = []


MasterStepKernel = Callable[..., bool]
"""``kernel(hyper, params, grads, masters, exp_avgs, exp_avg_sqs, steps) -> bool``: steps one
param group's FP32 masters and rounds them into the parameters; False when it cannot serve the
group (torch's AdamW then does)."""


def set_master_step_kernel(optimizer: torch.optim.Optimizer, kernel: MasterStepKernel) -> None:
    """Have ``kernel`` step the FP32 masters of groups with ``fused`` set (see module docs).

    Example::

        set_master_step_kernel(optimizer, master_adamw.one_pass_step)
    """
    optimizer._litegen_master_kernel = kernel


def _keep_fp32_state(optimizer, state_dict: dict) -> None:
    # Optimizer.load_state_dict casts floating state to its parameter's dtype, which would round
    # the masters and moments of a bf16 parameter to bf16: keep them aside, by parameter.
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    kept = {}
    for saved_id, p in zip(saved_ids, params, strict=False):
        state = state_dict["state"].get(saved_id, {})
        fp32 = {
            key: state[key]
            for key in ("master", *_MOMENTS)
            if key in state and state[key].dtype == torch.float32
        }
        if p.dtype in _LOW_PRECISION and fp32:
            kept[p] = fp32
    optimizer._litegen_fp32_state = kept  # replaces what a failed earlier load left


def _restore_fp32_state(optimizer) -> None:
    for p, fp32 in optimizer.__dict__.pop("_litegen_fp32_state", {}).items():
        optimizer.state[p].update({k: v.to(device=p.device) for k, v in fp32.items()})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of the same kind as ``param`` (a DTensor with its placements)."""
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


def _master_state(optimizer, p: torch.Tensor, fused: bool) -> dict:
    state = optimizer.state[p]
    local = _local(p.detach())
    if "master" not in state:
        state["master"] = _like(p, local.float().clone())
    for key in ("master", *_MOMENTS):
        # FP32 state; one loaded from a run without masters may hold bf16 moments (and a
        # low-precision master, from elsewhere, continues in FP32 from its rounded value).
        if key not in state:
            state[key] = _like(p, torch.zeros_like(local, dtype=torch.float32))
        elif state[key].dtype != torch.float32:
            state[key] = state[key].float()
    if "step" not in state:
        device = local.device if fused else torch.device("cpu")
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
    return state


@torch.no_grad()
def _master_step(optimizer, args, kwargs) -> None:
    hidden = optimizer._litegen_hidden_grads
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None and p.dtype in _LOW_PRECISION]
        if not params:
            continue
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError(
                "fp32_master_weights does not support AdamW(amsgrad=True) or maximize=True; "
                "turn those off or set fp32_master_weights: false."
            )
        fused = bool(group.get("fused"))
        states = [_master_state(optimizer, p, fused) for p in params]
        tensors = (
            [_local(p.detach()) for p in params],
            [_local(p.grad) for p in params],
            [_local(s["master"]) for s in states],
            [_local(s["exp_avg"]) for s in states],
            [_local(s["exp_avg_sq"]) for s in states],
            [s["step"] for s in states],
        )
        kernel = getattr(optimizer, "_litegen_master_kernel", None) if fused else None
        _adamw_on_masters(group, fused, kernel, *tensors)
        for p in params:
            # Hide the gradient so the optimizer's own step skips this parameter.
            hidden.append((p, p.grad))
            p.grad = None


def _adamw_on_masters(
    group, fused, kernel, params, grads, masters, exp_avgs, exp_avg_sqs, steps
) -> None:
    """Step the FP32 ``masters`` with ``grads`` and round them into ``params``."""
    hyper = {
        "lr": group["lr"],
        "betas": tuple(group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
    }
    if kernel is not None and kernel(hyper, params, grads, masters, exp_avgs, exp_avg_sqs, steps):
        return
    grads32 = [torch.empty_like(m) for m in masters]
    # Multi-tensor copies (casting): one pair of kernels per few hundred tensors on CUDA.
    torch._foreach_copy_(grads32, grads)
    adam(
        masters,
        grads32,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        # The group's own choice; None lets torch choose as AdamW does (foreach on CUDA): a
        # loop over the tensors would launch ~10 kernels per tensor, thousands for LoRA.
        foreach=group.get("foreach"),
        fused=fused or None,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=hyper["betas"][0],
        beta2=hyper["betas"][1],
        lr=hyper["lr"],
        weight_decay=hyper["weight_decay"],
        eps=hyper["eps"],
        maximize=False,
    )
    torch._foreach_copy_(params, masters)  # round to nearest into bf16/fp16


def _restore_grads(optimizer, args, kwargs) -> None:
    for p, grad in optimizer._litegen_hidden_grads:
        p.grad = grad
    optimizer._litegen_hidden_grads.clear()
