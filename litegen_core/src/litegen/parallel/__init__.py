"""Parallel strategies behind one interface (``Strategy``), chosen by name from the config.

A strategy is one module and one line in :data:`STRATEGIES`; the config's
``optimization.parallel.strategy`` accepts exactly these names. This package imports nothing at
load (the config reads the names without torch), and a strategy's module loads only when a job
uses it, so a DDP job never imports FSDP machinery.

Example::

    from litegen.parallel import STRATEGIES, build_strategy
    strategy = build_strategy(plan, config.optimization)
    strategy.name
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from litegen.parallel.base import Strategy
    from litegen.parallel.plan import ParallelPlan

# strategy name -> "module:Class"
STRATEGIES: dict[str, str] = {
    "ddp": "litegen.parallel.ddp:DDPStrategy",
    "zero1": "litegen.parallel.zero1:Zero1Strategy",
    "zero2": "litegen.parallel.zero2:Zero2Strategy",
    "fsdp1": "litegen.parallel.fsdp1:Fsdp1Strategy",
    "fsdp2": "litegen.parallel.fsdp2:Fsdp2Strategy",
    "hsdp": "litegen.parallel.fsdp2:HsdpStrategy",
}

# Options that only some strategies read: config path -> the strategies that read it. Set away
# from its default under any other strategy, an option does nothing, and the config warns
# (litegen.config.checks.ignored_options). Options every strategy reads are not listed.
STRATEGY_OPTIONS: dict[str, tuple[str, ...]] = {
    "optimization.parallel.zero1": ("zero1", "zero2"),
    "optimization.parallel.fsdp2": ("fsdp2", "hsdp"),
    "optimization.precision.fsdp2_mixed": ("fsdp1", "fsdp2", "hsdp"),
    "optimization.optimizer.fp32_master_weights": ("ddp", "zero1", "zero2", "fsdp2", "hsdp"),
    "ema.sharded": ("ddp", "zero1", "zero2", "fsdp2", "hsdp"),
}

__all__ = [
    "STRATEGIES",
    "STRATEGY_OPTIONS",
    "ParallelPlan",
    "Strategy",
    "build_strategy",
    "strategy_class",
]


def strategy_class(name: str) -> type[Strategy]:
    """The class registered under ``name`` (its module is imported now).

    Example:
        >>> strategy_class("fsdp2").master_weights
        True
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"optimization.parallel.strategy {name!r} is unknown; use one of "
            f"{', '.join(STRATEGIES)}."
        )
    module_name, class_name = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_strategy(plan: ParallelPlan, optimization: Any) -> Strategy:
    """Instantiate the strategy the plan names, for one ``optimization`` section.

    Example::

        build_strategy(plan, config.optimization).name
    """
    return strategy_class(plan.strategy)(plan, optimization)


def __getattr__(name: str) -> Any:
    if name == "Strategy":
        from litegen.parallel.base import Strategy

        return Strategy
    if name == "ParallelPlan":
        from litegen.parallel.plan import ParallelPlan

        return ParallelPlan
    raise AttributeError(f"module 'litegen.parallel' has no attribute {name!r}")
