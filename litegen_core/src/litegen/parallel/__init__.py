"""Parallel strategies behind one interface (``Strategy``), chosen by name from the config.

Modules load on demand so a DDP job never imports FSDP machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

from litegen.parallel.base import Strategy
from litegen.parallel.plan import ParallelPlan

# strategy name -> "module:Class"; a strategy is added by one line here and one module.
STRATEGIES: dict[str, str] = {
    "ddp": "litegen.parallel.ddp:DDPStrategy",
    "zero1": "litegen.parallel.zero1:Zero1Strategy",
    "zero2": "litegen.parallel.zero2:Zero2Strategy",
    "fsdp1": "litegen.parallel.fsdp1:Fsdp1Strategy",
    "fsdp2": "litegen.parallel.fsdp2:Fsdp2Strategy",
    "hsdp": "litegen.parallel.fsdp2:HsdpStrategy",
}

__all__ = ["STRATEGIES", "ParallelPlan", "Strategy", "build_strategy"]


def build_strategy(plan: ParallelPlan, optimization: Any) -> Strategy:
    """Instantiate the strategy the plan names.

    Example:
        >>> build_strategy(plan, config.optimization).name
        'ddp'
    """
    if plan.strategy not in STRATEGIES:
        raise NotImplementedError(
            f"optimization.parallel.strategy '{plan.strategy}' is not implemented yet; "
            f"available: {', '.join(sorted(STRATEGIES))}."
        )
    module_name, class_name = STRATEGIES[plan.strategy].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(plan, optimization)
