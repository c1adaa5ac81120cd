"""The peak device memory of one training step of one model, estimated without running it.

The model is built on the meta device, gets the changes ``prepare`` makes to what it stores
(:func:`litegen.runtime.steps.apply_estimate_steps`: LoRA adapters, then the steps of
``prepare``'s list that change the stored weights, ``cast_model`` and ``fp8_base``), and one micro-batch's forward runs on meta under ``saved_tensors_hooks``
(:mod:`litegen.memory.saved_bytes`): shapes and dtypes only, no memory, no compute. Everything
is in bytes, for one rank holding the whole model.

* weights: every parameter and buffer, in its dtype (``fp8_base`` frozen Linears at one byte
  per element plus their scales). With ``block_swap`` the frozen parameters of the repeated
  blocks after the first ``blocks_on_device`` wait in host memory; the device holds two of
  them in flight (the block running and the one being fetched). With fsdp2 ``cpu_offload``
  only the largest unit (a repeated block, or everything outside them) is on the device;
* gradients: one per trainable parameter, in its dtype; none with ``cpu_offload``;
* optimizer: AdamW's two moments per trainable parameter in its dtype; with
  ``fp32_master_weights`` (where the strategy keeps masters) a bf16/fp16 parameter has an FP32
  master and FP32 moments instead, 12 bytes per element; none with ``cpu_offload``. The scalar
  step counters are left out;
* activations: the rest of the peak. The blocks are those activation checkpointing chooses from
  (``target_paths``, else the model's repeated blocks); per block, what it saves without
  checkpointing (``a``), its own inputs (``i``, kept when checkpointed) and its outputs (``o``).
  The ``ops_all`` and ``ops`` policies keep the block's matmul/attention outputs (all but the
  widening linears' for ``ops``) with its inputs. Like the budget planner
  (:mod:`litegen.memory.budget_estimate`, whose ``candidate_choices`` does the sum), the step
  is cut into phases, named by how many leading blocks still hold what they keep; with every
  block checkpointed::

    forward end (n blocks hold):   W + O + outside + sum(i)          (+ G with grad accumulation)
    backward of block j (j hold):  W + O + G + outside + sum(i[:j]) + i[j] + a[j] + 2 o[j]

  where ``outside`` is what the forward saves outside the blocks, and block ``j``'s backward
  holds its recomputed activations, the gradient reaching it and the one it passes on. A block
  left out of checkpointing adds its ``a`` to every phase it holds in; offloaded blocks take
  theirs off, plus ``blocks_in_flight`` copies in flight. The peak is the largest phase, always a
  backward one (the last block's backward holds at least what the forward's end does), so
  ``activations = peak - weights - gradients - optimizer``.

Not counted: the allocator's caching and fragmentation, the CUDA context, kernels' temporary
workspaces (cuBLAS, attention), the transients of a block's forward (its intermediates that
autograd does not save), the optimizer step's temporaries, communication buffers, sharding over
ranks, and ``fp8_linear`` (weights stay in their dtype; saved activations are counted in the
compute dtype). ``selective_ratio: auto`` is the planner's choice for ``budget_bytes`` (every
block checkpointed without one); ``policy: memory_budget`` counts as no checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from litegen.memory.budget_estimate import BlockCost, candidate_choices, choose
from litegen.memory.offload import BLOCKS_IN_FLIGHT
from litegen.memory.saved_bytes import SavedBytes, count_saved_bytes
from litegen.model_parts.blocks import repeated_blocks

SWAP_IN_FLIGHT = 2  # block swap: the block running and the one being fetched
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PeakEstimate:
    """One step's estimated peak on the device and its parts, in bytes (module doc)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    peak: int
    blocks: int  # the candidate blocks found
    checkpointed: int
    offloaded: int


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _frozen(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if not p.requires_grad]


def resident_weight_bytes(
    model: nn.Module, *, blocks_on_device: int | None = None, cpu_offload: bool = False
) -> int:
    """Bytes of ``model``'s parameters and buffers on the device during a step (module doc).

    Example:
        >>> net = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4)) for _ in range(4))).requires_grad_(False)
        >>> resident_weight_bytes(net), resident_weight_bytes(net, blocks_on_device=1)
        (320, 240)
    """
    everything = _nbytes([*model.parameters(), *model.buffers()])
    paths = repeated_blocks(model)
    blocks = [model.get_submodule(p) for p in paths]
    if cpu_offload:
        units = [_nbytes([*b.parameters(), *b.buffers()]) for b in blocks]
        return max([everything - sum(units), *units])
    if blocks_on_device is None:
        return everything
    swapped = [_nbytes(_frozen(b)) for b in blocks[blocks_on_device:]]
    in_flight = sorted(swapped, reverse=True)[:SWAP_IN_FLIGHT]
    return everything - sum(swapped) + sum(in_flight)


def gradient_bytes(model: nn.Module, *, cpu_offload: bool = False) -> int:
    """Bytes of the gradients of ``model``'s trainable parameters on the device.

    Example:
        >>> gradient_bytes(nn.Linear(4, 4))  # (16 + 4) float32
        80
    """
    return 0 if cpu_offload else _nbytes(p for p in model.parameters() if p.requires_grad)


def optimizer_bytes(
    model: nn.Module, *, master_weights: bool = False, cpu_offload: bool = False
) -> int:
    """Bytes of AdamW's state for ``model``'s trainable parameters on the device (module doc).

    Example:
        >>> bf16 = nn.Linear(4, 4).to(torch.bfloat16)
        >>> optimizer_bytes(bf16), optimizer_bytes(bf16, master_weights=True)
        (80, 240)
    """
    if cpu_offload:
        return 0
    total = 0
    for p in {id(p): p for p in model.parameters() if p.requires_grad}.values():
        masters = master_weights and p.dtype in _LOW_PRECISION
        total += p.numel() * (3 * 4 if masters else 2 * p.element_size())
    return total


def block_costs(saved: SavedBytes, policy: str) -> dict[str, BlockCost]:
    """Each block's cost for the planner: checkpointed, it keeps ``input_bytes`` (its inputs,
    plus the op outputs the policy saves); left out, ``activation_bytes`` more.

    Example:
        >>> from litegen.memory.saved_bytes import BlockSaves
        >>> saved = SavedBytes({"b.0": BlockSaves(activation_bytes=100, input_bytes=10, op_output_bytes=60)})
        >>> block_costs(saved, "block")["b.0"], block_costs(saved, "ops_all")["b.0"]
        (BlockCost(activation_bytes=100, input_bytes=10), BlockCost(activation_bytes=40, input_bytes=70))
    """
    costs = {}
    for path, s in saved.blocks.items():
        kept = {"ops_all": s.op_output_bytes, "ops": s.op_output_bytes - s.widening_bytes}
        kept_ops = kept.get(policy, 0)
        costs[path] = BlockCost(s.activation_bytes - kept_ops, s.input_bytes + kept_ops)
    return costs


def phase_peaks(
    saved: SavedBytes,
    costs: dict[str, BlockCost],
    base: int,
    grads: int,
    *,
    grads_in_forward: bool,
) -> dict[int, int]:
    """Each phase's peak with every block checkpointed (the module doc's table); ``base`` is
    weights plus optimizer state, ``grads`` the gradients.

    Example:
        >>> from litegen.memory.saved_bytes import BlockSaves
        >>> saved = SavedBytes({"b.0": BlockSaves(100, 10, output_bytes=10)}, outside_bytes=5)
        >>> phase_peaks(saved, block_costs(saved, "block"), 1000, 50, grads_in_forward=False)
        {1: 1015, 0: 1185}
    """
    paths = list(costs)
    inputs = [costs[p].input_bytes for p in paths]
    start = base + saved.outside_bytes
    peaks = {len(paths): start + sum(inputs) + (grads if grads_in_forward else 0)}
    for j, path in enumerate(paths):
        s = saved.blocks[path]
        working = costs[path].activation_bytes + 2 * s.output_bytes
        peaks[j] = start + grads + sum(inputs[: j + 1]) + working
    return peaks


def estimate_peak(
    model: nn.Module,
    optimization: Any,
    forward: Callable[[], Any],
    *,
    grad_accum_steps: int = 1,
    budget_bytes: int | None = None,
    master_weights: bool | None = None,
) -> PeakEstimate:
    """Estimate one training step's peak for ``model`` (prepared with
    :func:`litegen.runtime.steps.apply_estimate_steps`), running ``forward()`` once to count what it saves.

    ``optimization`` is an ``OptimizationConfig``; ``master_weights`` whether the strategy keeps
    FP32 masters (default: ``optimizer.fp32_master_weights`` as the strategy table says);
    ``budget_bytes`` the budget ``selective_ratio: auto`` plans for.

    Example:
        >>> from litegen.config import OptimizationConfig
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)))
        >>> x = torch.empty(32, 64, device="meta")
        >>> est = estimate_peak(net, OptimizationConfig(), lambda: net(x).sum())
        >>> est.weights, est.gradients, est.optimizer, est.peak > est.weights + est.activations
        (66560, 66560, 133120, True)
    """
    from litegen.config.strategies import FSDP2_OPTIONS, STRATEGIES

    memory, parallel = optimization.memory, optimization.parallel
    row = STRATEGIES[parallel.strategy]
    cpu_offload = bool(parallel.fsdp2.cpu_offload) and FSDP2_OPTIONS in row.options
    if master_weights is None:
        master_weights = optimization.optimizer.fp32_master_weights and row.master_weights
    swap = memory.block_swap
    weights = resident_weight_bytes(
        model,
        blocks_on_device=None if swap is None else swap.blocks_on_device,
        cpu_offload=cpu_offload,
    )
    grads = gradient_bytes(model, cpu_offload=cpu_offload)
    state = optimizer_bytes(model, master_weights=master_weights, cpu_offload=cpu_offload)
    ac = memory.activation_checkpoint
    paths = list(ac.target_paths) if ac.target_paths else repeated_blocks(model)
    saved = count_saved_bytes(model, paths, forward)
    checkpointing = ac.enabled and ac.policy != "memory_budget"
    costs = block_costs(saved, ac.policy if checkpointing else "block")
    peaks = phase_peaks(saved, costs, weights + state, grads, grads_in_forward=grad_accum_steps > 1)
    if not costs:  # no blocks: the one phase is the whole step
        peak = weights + state + grads + saved.outside_bytes
        return PeakEstimate(weights, grads, state, peak - weights - state - grads, peak, 0, 0, 0)
    offload = bool(memory.activation_offload) and len(paths) > 1  # never the last block
    plans = candidate_choices(costs, peaks, 0.0, 1.0, offload, BLOCKS_IN_FLIGHT)
    if offload:  # a static choice offloads every candidate but the last
        plans = [p for p in plans if p.offloaded]
    auto = checkpointing and ac.selective_ratio == "auto"
    if auto and budget_bytes is not None:
        plan, _ = choose(plans, budget_bytes)
    else:
        k = len(paths) if auto else (ac.checkpointed_blocks(len(paths)) or 0)
        plan = next(p for p in plans if len(p.checkpointed) == (k if checkpointing else 0))
    peak = plan.estimate_bytes
    activations = peak - weights - grads - state
    return PeakEstimate(
        weights,
        grads,
        state,
        activations,
        peak,
        len(paths),
        len(plan.checkpointed),
        len(plan.offloaded),
    )


__all__ = [
    "PeakEstimate",
    "block_costs",
    "estimate_peak",
    "gradient_bytes",
    "optimizer_bytes",
    "phase_peaks",
    "resident_weight_bytes",
]
