"""``selective_ratio: auto``: checkpoint the fewest blocks that fit a memory budget.

The plan needs one training step's figures, so the first step measures and the choice applies
from the second. Every candidate block carries a :class:`~litegen.memory.block_forward.BlockForward`
whose switches the planner sets; compiled blocks hold one compiled callable per mode, so the
switch costs at most one more compile per mode.

First step (until the first ``torch.optim`` optimizer step): every candidate runs checkpointed,
which is what fits best, so the measuring step itself fits whenever anything does. During the
first forward each block is also run once without checkpointing under saved-tensor hooks that
count and drop what it saves (the RNG state forked, the output discarded), so measuring costs
one extra forward and one block's activations at a time. Per block:

* ``activation_bytes``: what it saves when not checkpointed, counted per storage, leaving out
  its inputs, parameters (as they are while it runs: block swap's device copies, FSDP's gathered
  unit) and outputs (alive in either mode);
* ``input_bytes``: what checkpointing keeps for it alone: its saved inputs that no other block
  also saves (shared ones, like text embeddings, stay either way).

On CUDA the allocator gives the rest, as the peaks of the first step's phases, because blocks
left out hold their activations only until their own backward: the forward (until the last block's
output gradient arrives), then each block's backward (from its output gradient to the next
block's), with later micro-batches and the optimizer step as phases of their own. A phase's peak
is the maximum allocated in it (the counting runs left out) plus the optimizer state (allocated
when the plan is made minus allocated at the first block). On CPU, which has no allocator
statistics, the one phase is the forward and its peak the bytes the checkpointed blocks saved, so
the budget covers saved activations only.

Each plan's estimated peak and cost, and the choice between plans, are in
:mod:`litegen.memory.budget_estimate`. Under ``torch.distributed`` every rank plans with the
maximum of all ranks' figures, so all ranks choose the same blocks.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_leaves

from litegen.memory.block_forward import BlockForward
from litegen.memory.budget_estimate import BlockCost, BudgetChoice, candidate_choices, choose
from litegen.memory.offload import BLOCKS_IN_FLIGHT

log = logging.getLogger("litegen")

GIB = 2**30
_BANDWIDTH_PROBE_BYTES = 64 * 2**20


@dataclass
class _Measurement:
    costs: dict[str, BlockCost]
    saved_by: dict[int, set[str]] = field(default_factory=dict)  # storage -> blocks saving it
    storage_bytes: dict[int, int] = field(default_factory=dict)
    timings: list[tuple[Any, Any]] = field(default_factory=list)  # CUDA events per block call
    seen: set[int] = field(default_factory=set)  # blocks called in the current forward
    forwards: int = 0
    before: int = 0  # allocated at the first block
    # phase -> its highest allocated outside the counting runs; a phase is named by how many
    # blocks (in forward order) still hold their activations in it (module doc)
    peaks: dict[int, int] = field(default_factory=dict)
    phase: int | None = None  # the phase under way (None: not measuring the allocator)


def _storages(tree: Any) -> set[int]:
    """Where the tensors in ``tree`` keep their data."""
    found = set()
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            try:
                found.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # subclasses without one storage
                continue
    return found


def _discard(_: Any) -> torch.Tensor:
    raise RuntimeError("a counting run of the budget planner has no backward")


class BudgetChooser:
    """Measures the first step, then sets every candidate's checkpoint and offload switches.

    Example::

        planner = BudgetChooser(blocks, budget_bytes=40 * 2**30, may_offload=True)
        # step 1 runs every block checkpointed; from step 2, planner.plan holds the choice
    """

    def __init__(
        self,
        blocks: dict[str, BlockForward],
        *,
        budget_bytes: int | None = None,
        budget_fraction: float = 0.9,
        may_offload: bool = False,
        blocks_in_flight: int = BLOCKS_IN_FLIGHT,
        on_plan: Any = None,
    ) -> None:
        self.blocks = blocks
        self.budget_bytes = budget_bytes
        self.budget_fraction = budget_fraction
        self.may_offload = may_offload
        self.blocks_in_flight = blocks_in_flight
        self.on_plan = on_plan  # called with the chosen BudgetChoice (the MemoryReport's update)
        self.plan: BudgetChoice | None = None
        self.budget: int | None = None
        self._measured = _Measurement({path: BlockCost() for path in blocks})
        self._paths = {id(block): path for path, block in blocks.items()}
        self._stepped = False
        self._hooks = [
            register_optimizer_step_pre_hook(self._before_optimizer_step),
            register_optimizer_step_post_hook(self._optimizer_step),
        ]
        self._device: torch.device | None = None
        for block in blocks.values():
            block.checkpoint, block.offload, block.meter = True, False, self

    @property
    def measuring(self) -> bool:
        """Whether the step under way is the measuring one (its extra forwards are not training's)."""
        return not self._stepped

    def _before_optimizer_step(self, *_: Any) -> None:
        m = self._measured
        if m.forwards > 0 and not self._stepped and m.phase is not None:
            self._next_phase(None)
            # the optimizer step: parameters and gradients, no block holding anything
            m.peaks[0] = max(m.peaks.get(0, 0), torch.cuda.memory_allocated(self._device))

    def _optimizer_step(self, *_: Any) -> None:
        # Steps before this model's first forward (another model's optimizer) end nothing.
        self._stepped = self._measured.forwards > 0

    def _next_phase(self, held: int | None) -> None:
        """Close the phase under way (its allocator peak noted) and open the one holding ``held``."""
        m = self._measured
        if m.phase is None:
            return
        peak = torch.cuda.max_memory_allocated(self._device)
        m.peaks[m.phase] = max(m.peaks.get(m.phase, 0), peak)
        torch.cuda.reset_peak_memory_stats(self._device)
        m.phase = held

    # -- the first step ----------------------------------------------------------------------
    def call(self, block: BlockForward, args: tuple, kwargs: dict[str, Any]) -> Any:
        """One training call of ``block`` while the planner is installed (``BlockForward``)."""
        if self._stepped:
            self.decide()
            return block.run(args, kwargs)
        m = self._measured
        if id(block) in m.seen or not m.seen:
            m.seen.clear()
            m.forwards += 1
            if m.forwards == 1:
                self._start(block, args, kwargs)
            else:  # a later micro-batch: every block holds its activations again
                self._next_phase(len(self.blocks))
        m.seen.add(id(block))
        if m.forwards > 1:  # later micro-batches: only the allocator's peak keeps counting
            return block.run(args, kwargs)
        path = self._paths[id(block)]
        self._count_plain(block, path, args, kwargs)
        return self._run_counted(block, path, args, kwargs)

    def _start(self, block: BlockForward, args: tuple, kwargs: dict[str, Any]) -> None:
        devices = [t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices += [p.device for p in block.module.parameters()]
        self._device = devices[0] if devices else torch.device("cpu")
        if self._device.type == "cuda":
            self._measured.before = torch.cuda.memory_allocated(self._device)
            self._measured.phase = len(self.blocks)  # the forward
            torch.cuda.reset_peak_memory_stats(self._device)

    def _count_plain(
        self, block: BlockForward, path: str, args: tuple, kwargs: dict[str, Any]
    ) -> None:
        """What ``block`` would save without checkpointing, counted and dropped at once."""
        module = block.module
        kept = _storages((args, kwargs)) | _storages(list(module.buffers()))
        params: set[int] = set()  # read at the first save: block swap puts its copies in place
        made: dict[int, int] = {}
        held = []  # alive until the run ends, so no two of them share an address

        def count(t: torch.Tensor) -> None:
            if not params:
                params.update(_storages(list(module.parameters())))
            if type(t) is torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in kept and storage.data_ptr() not in params:
                    made[storage.data_ptr()] = storage.nbytes()
                    held.append(t)

        cuda = self._device is not None and self._device.type == "cuda"
        if cuda:
            m = self._measured
            peak = torch.cuda.max_memory_allocated(self._device)
            m.peaks[m.phase] = max(m.peaks.get(m.phase, 0), peak)
        block.counting = True
        try:
            with (
                torch.random.fork_rng(devices=[self._device] if cuda else []),
                saved_tensors_hooks(count, _discard),
            ):
                out = block.plain(*args, **kwargs)
        finally:
            block.counting = False
        outputs = _storages(out)
        del out
        held.clear()
        activation = sum(n for ptr, n in made.items() if ptr not in outputs)
        cost = self._measured.costs[path]
        cost.activation_bytes = max(cost.activation_bytes, activation)
        if cuda:  # the counting run's own peak is not the step's
            torch.cuda.reset_peak_memory_stats(self._device)

    def _run_counted(self, block: BlockForward, path: str, args: tuple, kwargs: dict) -> Any:
        """The checkpointed call itself, noting which storages it saves."""
        m = self._measured
        params = _storages(list(block.module.parameters()))

        def note(t: torch.Tensor) -> torch.Tensor:
            if type(t) is torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in params:
                    m.saved_by.setdefault(storage.data_ptr(), set()).add(path)
                    m.storage_bytes[storage.data_ptr()] = storage.nbytes()
            return t

        timed = self._device is not None and self._device.type == "cuda"
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with saved_tensors_hooks(note, lambda t: t):
            out = block.run(args, kwargs)
        if timed:
            end.record()
            m.timings.append((start, end))
            grads_out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            grads_out = [t for t in grads_out if t.requires_grad]
            if grads_out:  # its backward starts when the gradient of its output arrives
                held = list(self.blocks).index(path)
                grads_out[0].register_hook(lambda _: self._next_phase(held))
        return out

    # -- the plan ----------------------------------------------------------------------------
    def decide(self) -> BudgetChoice:
        """Choose and apply the plan from what the first step measured (module doc)."""
        for hook in self._hooks:
            hook.remove()
        m = self._measured
        paths = list(self.blocks)
        for ptr, owners in m.saved_by.items():
            if len(owners) == 1:
                m.costs[next(iter(owners))].input_bytes += m.storage_bytes[ptr]
        device = self._device or torch.device("cpu")
        cuda = device.type == "cuda"
        n = len(paths)
        if cuda:
            self._next_phase(None)
            state = torch.cuda.memory_allocated(device) - m.before  # the optimizer's, mostly
            peaks = [m.peaks[held] + state if held in m.peaks else 0 for held in range(n + 1)]
            for _, end in m.timings:
                end.synchronize()
            # the median: the first call of a compiled block also compiles it
            times = [s.elapsed_time(e) / 1e3 for s, e in m.timings]
            block_s = statistics.median(times) if times else 0.0
            total = torch.cuda.get_device_properties(device).total_memory
            budget = self.budget_bytes or int(self.budget_fraction * total)
        else:
            if self.budget_bytes is None:
                raise ValueError(
                    "activation_checkpoint.selective_ratio: auto on a device without memory "
                    "statistics (cpu) needs memory_budget_gib; set it."
                )
            block_s, budget = 1.0, self.budget_bytes
            peaks = [0] * n + [sum(m.storage_bytes.values())]
        figures = [block_s, *(float(b) for b in peaks)]
        figures += [float(m.costs[p].activation_bytes) for p in paths]
        figures += [float(m.costs[p].input_bytes) for p in paths]
        figures = _max_over_ranks(figures, device)
        block_s = figures[0]
        phases = {held: int(b) for held, b in enumerate(figures[1 : n + 2]) if b > 0} or {n: 0}
        costs = {
            p: BlockCost(int(figures[n + 2 + i]), int(figures[2 * n + 2 + i]))
            for i, p in enumerate(paths)
        }
        offload = self.may_offload and cuda
        bandwidth = _copy_bandwidth(device) if offload else 0.0
        plans = candidate_choices(costs, phases, block_s, bandwidth, offload, self.blocks_in_flight)
        chosen, fits = choose(plans, budget)
        self._apply(chosen, budget, costs, max(phases.values()), fits)
        return chosen

    def _apply(
        self,
        plan: BudgetChoice,
        budget: int,
        costs: dict[str, BlockCost],
        measured: int,
        fits: bool,
    ) -> None:
        for path, block in self.blocks.items():
            block.checkpoint = path in plan.checkpointed
            block.offload = path in plan.offloaded
            block.meter = None
        self.plan, self.budget = plan, budget
        if self.on_plan is not None:
            self.on_plan(plan)
        widest = max((c.activation_bytes for c in costs.values()), default=0)
        message = (
            "activation checkpointing (auto): %d of %d blocks checkpointed, %d offloaded; "
            "estimated peak %.2f GiB for a budget of %.2f GiB (measured on the first step: "
            "%.2f GiB with every block checkpointed, up to %.2f GiB more per block left out)"
        )
        values = (
            len(plan.checkpointed),
            len(self.blocks),
            len(plan.offloaded),
            plan.estimate_bytes / GIB,
            budget / GIB,
            measured / GIB,
            widest / GIB,
        )
        if fits:
            log.info(message, *values)
        else:
            log.warning(message + "; no plan fits, this one needs the least", *values)


def _max_over_ranks(figures: list[float], device: torch.device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return figures
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(figures, dtype=torch.float64, device=on)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of one device-to-pinned-host copy (timed once, when planning)."""
    source = torch.empty(_BANDWIDTH_PROBE_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(_BANDWIDTH_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host.copy_(source, non_blocking=True)
    end.record()
    end.synchronize()
    return _BANDWIDTH_PROBE_BYTES / (start.elapsed_time(end) / 1e3)


__all__ = ["BlockCost", "BudgetChoice", "BudgetChooser", "candidate_choices", "choose"]


def __getattr__(name: str) -> Any:
    # Earlier names of this module's classes and functions, with a warning naming the new one.
    from litegen.utils.moved_modules import renamed_attribute

    return renamed_attribute(__name__, name)
