"""Parallel strategies behind one interface (``Strategy``), chosen by name from the config.

A strategy is one module and one row of :data:`litegen.config.strategies.TABLE`, which names
its class; the config's ``optimization.parallel.strategy`` accepts exactly the table's names.
This package imports nothing heavy at load, and a strategy's module loads only when a job uses
it, so a DDP job never imports FSDP machinery.

Example::

    from litegen.parallel import build_strategy
    strategy = build_strategy(plan, config.optimization)
    strategy.name
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from litegen.config.strategies import STRATEGIES, STRATEGY_OPTIONS, strategy_row

if TYPE_CHECKING:
    from litegen.parallel.base import Strategy
    from litegen.parallel.plan import ParallelPlan

__all__ = [
    "STRATEGIES",
    "STRATEGY_OPTIONS",
    "ParallelPlan",
    "Strategy",
    "build_strategy",
    "strategy_class",
]


def strategy_class(name: str) -> type[Strategy]:
    """The class the table names for ``name`` (its module is imported now).

    Example:
        >>> strategy_class("fsdp2").__name__
        'Fsdp2Strategy'
    """
    module_name, class_name = strategy_row(name).implementation.split(":")
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
