"""The budget planner's arithmetic: each plan's estimated peak and cost, and the choice.

:mod:`litegen.memory.budget` measures the first step (the phases, ``activation_bytes`` and
``input_bytes`` are defined there); these functions turn its figures into plans and pick one.

A plan checkpoints ``k`` blocks spread evenly (as ``selective_ratio`` does) and, if
``activation_offload`` allows it and on CUDA only, offloads every candidate but the last. In
each phase the blocks that precede it (every block, in the forward and in later micro-batches)
still hold what they keep:

    estimate = max over phases (phase peak + activation_bytes of held blocks not checkpointed
                                - offloaded by held blocks) + in flight

where ``offloaded`` is what leaves the device (a checkpointed block's own inputs; another
block's activations and inputs) and ``in flight`` is ``blocks_in_flight`` times the largest
block's share. Its cost in seconds is ``k`` recomputed block forwards (the first step's median
block forward, timed with CUDA events) plus the offload copies the forward cannot hide (bytes
over the measured device-to-host bandwidth, beyond the forward's duration). The cheapest plan
within the budget wins, fewer offloaded blocks breaking ties; when none fits, the one with the
smallest estimate runs and a warning says by how much it misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litegen.memory.checkpointing import spread_evenly
from litegen.memory.offload import BLOCKS_IN_FLIGHT


@dataclass
class BlockCost:
    """What one candidate block adds to memory (defined in :mod:`litegen.memory.budget`)."""

    activation_bytes: int = 0
    input_bytes: int = 0


@dataclass(frozen=True)
class BudgetChoice:
    """One choice: blocks checkpointed, blocks offloaded, its estimated peak and cost."""

    checkpointed: tuple[str, ...]
    offloaded: tuple[str, ...]
    estimate_bytes: int
    cost_s: float


def candidate_choices(
    costs: dict[str, BlockCost],
    peaks: dict[int, int],
    block_s: float,
    bandwidth: float,
    offload: bool,
    blocks_in_flight: int = BLOCKS_IN_FLIGHT,
) -> list[BudgetChoice]:
    """Every plan: ``k`` = 0..n checkpointed blocks, without and (if allowed) with offload.

    ``costs`` are the candidates' in forward order; ``peaks`` maps a phase of the measured step
    (named by how many leading blocks hold their activations in it) to its peak with every block
    checkpointed; ``block_s`` is one block's forward in seconds; ``bandwidth`` device-to-host
    bytes per second (module doc).

    Example:
        >>> costs = {"b.0": BlockCost(100, 10), "b.1": BlockCost(100, 10)}
        >>> # the forward peaks at 1000, the end of backward (no block holding anything) at 1150
        >>> plans = candidate_choices(costs, {2: 1000, 0: 1150}, 1.0, 0.0, offload=False)
        >>> [p.estimate_bytes for p in plans]
        [1200, 1150, 1150]
    """
    paths = list(costs)
    n = len(paths)
    plans = []
    for offloading in (False, True) if offload else (False,):
        offloaded = set(paths[:-1]) if offloading else set()
        for k in range(n + 1):
            checkpointed = tuple(spread_evenly(paths, k))
            # what each block holds on the device beyond its all-checkpointed self, and moves off
            extra = [0 if p in checkpointed else costs[p].activation_bytes for p in paths]
            moved = [
                costs[p].input_bytes + e if p in offloaded else 0
                for p, e in zip(paths, extra, strict=True)
            ]
            estimate = max(
                peak + sum(extra[:held]) - sum(moved[:held]) for held, peak in peaks.items()
            )
            if offloaded:
                estimate += blocks_in_flight * max(moved)
            copy_s = sum(moved) / bandwidth if offloaded else 0.0
            cost = k * block_s + max(0.0, copy_s - n * block_s)  # copies beyond the forward
            plans.append(
                BudgetChoice(
                    checkpointed, tuple(p for p in paths if p in offloaded), estimate, cost
                )
            )
    return plans


def choose(plans: list[BudgetChoice], budget: int) -> tuple[BudgetChoice, bool]:
    """The cheapest plan within ``budget`` (fewer offloaded blocks break ties), and True; else
    the plan with the smallest estimate, and False.

    Example:
        >>> costs = {"b.0": BlockCost(100, 10), "b.1": BlockCost(100, 10)}
        >>> plans = candidate_choices(costs, {2: 1000}, 1.0, 0.0, offload=False)
        >>> choose(plans, 1150)[0].checkpointed
        ('b.1',)
    """
    fitting = [p for p in plans if p.estimate_bytes <= budget]
    if fitting:
        return min(fitting, key=lambda p: (p.cost_s, len(p.offloaded))), True
    return min(plans, key=lambda p: p.estimate_bytes), False


def __getattr__(name: str) -> Any:
    # Earlier names of this module's classes and functions, with a warning naming the new one.
    from litegen.utils.moved_modules import renamed_attribute

    return renamed_attribute(__name__, name)
