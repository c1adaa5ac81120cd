"""Old import paths of moved modules: they keep working, with a ``DeprecationWarning`` naming
the new path.

``litegen/__init__.py`` installs :class:`MovedModuleFinder` once, so ``import litegen.blocks``
and ``from litegen.blocks import repeated_blocks`` load ``litegen.model_parts.blocks`` under both
names. A package that took an old module's name (``litegen.precision``, ``litegen.flops``)
forwards that module's names through its ``__getattr__`` and :func:`moved_attribute`. The same
finder serves the public paths the spec fixes from the module of their layer
(:data:`PUBLIC_PATHS`), without a warning.

    >>> import sys, warnings
    >>> _ = sys.modules.pop("litegen.blocks", None)  # a cached old name warns only once
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from litegen.blocks import repeated_blocks
    >>> "litegen.model_parts.blocks" in str(caught[0].message)
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

# old dotted path -> new dotted path; the one table of moves.
MOVED: dict[str, str] = {
    "litegen.precision": "litegen.precision.dtypes",
    "litegen.fp8_training": "litegen.precision.fp8_training",
    "litegen.fp8_weights": "litegen.precision.fp8_weights",
    "litegen.blocks": "litegen.model_parts.blocks",
    "litegen.module_paths": "litegen.model_parts.paths",
    "litegen.gelu_mlps": "litegen.model_parts.mlp_routing",
    "litegen.flops": "litegen.flops.throughput",
    "litegen.flop_counter": "litegen.flops.counting",
    "litegen.families.key_map": "litegen.model_keys.key_map",
    "litegen.families.original_format": "litegen.model_keys.original_format",
    "litegen.export": "litegen.finetune.export",
    "litegen.trainer.metrics": "litegen.instruments.metrics",
    "litegen.trainer.readback": "litegen.instruments.readback",
    "litegen.trainer.loss_guard": "litegen.instruments.loss_guard",
    # Renamed so that one name means one thing (docs/architecture.md, "Names").
    "litegen.parallel.sequence.plan": "litegen.parallel.sequence.sequence_plan",
    "litegen.parallel.sequence.plans": "litegen.parallel.sequence.builtin_plans",
    "litegen.parallel.buckets": "litegen.parallel.grad_buckets",
    "litegen.data.buckets": "litegen.data.shape_buckets",
    "litegen.trainer.media": "litegen.trainer.sample_files",
    "litegen.experimental.gelu_mlp": "litegen.experimental.fused_gelu_mlp_op",
    "litegen.experimental.mlp_fusion": "litegen.experimental.fused_gelu_mlp",
    "litegen.memory.chunked_mlp": "litegen.memory.mlp_token_chunks",
    "litegen.runtime.prepare": "litegen.runtime.prepare_arguments",
}

# Paths the spec fixes, served by the module of the layer its code belongs to: they load
# that module under both names, without a warning (they are not deprecated).
PUBLIC_PATHS: dict[str, str] = {
    "litegen.utils.encode": "litegen.data.vae_encode",
}

# module -> old public name -> new name in the same module.
RENAMED: dict[str, dict[str, str]] = {
    "litegen.runtime.steps": {"prepare_for_estimate": "apply_estimate_steps"},
    "litegen.parallel.wrap": {"plan_units": "select_wrap_units"},
    "litegen.memory": {"BudgetPlanner": "BudgetChooser", "BudgetPlan": "BudgetChoice"},
    "litegen.memory.budget": {
        "BudgetPlanner": "BudgetChooser",
        "BudgetPlan": "BudgetChoice",
        "candidate_plans": "candidate_choices",
    },
    "litegen.memory.budget_estimate": {
        "BudgetPlan": "BudgetChoice",
        "candidate_plans": "candidate_choices",
    },
}


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; import it from there ({old} will be removed)",
        DeprecationWarning,
        stacklevel=3,
    )


def _is_package_now(old: str) -> bool:
    return any(new.startswith(old + ".") for new in MOVED.values())


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str, deprecated: bool = True) -> None:
        self.new = new
        self.deprecated = deprecated

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if self.deprecated:
            _warn(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported; nothing more to do."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds an old module path of :data:`MOVED`, or a path of :data:`PUBLIC_PATHS`, and loads
    the module it names under it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname in PUBLIC_PATHS:
            loader = _AliasLoader(PUBLIC_PATHS[fullname], deprecated=False)
            return importlib.machinery.ModuleSpec(fullname, loader)
        new = MOVED.get(fullname)
        if new is None or _is_package_now(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder in ``sys.meta_path`` once (ahead of the path finder, which would find
    nothing at the old path)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


def moved_attribute(package: str, name: str) -> Any:
    """``name`` of the module that ``package`` was before it became a package, with a warning.

    Example (in the package's ``__init__.py``)::

        def __getattr__(name):
            return moved_attribute(__name__, name)
    """
    new = MOVED.get(package)
    if new is None or name.startswith("__"):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    if importlib.util.find_spec(f"{package}.{name}") is not None:
        # A submodule of the package (``from litegen.flops import throughput``), not the old
        # module's attribute of the same name.
        return importlib.import_module(f"{package}.{name}")
    module = importlib.import_module(new)
    if not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{new}.{name}")
    return getattr(module, name)


def renamed_attribute(module: str, name: str) -> Any:
    """The renamed ``name`` of ``module`` under its new name, with a warning.

    Example (in the module)::

        def __getattr__(name):
            return renamed_attribute(__name__, name)
    """
    new = RENAMED.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{module}.{new}")
    return getattr(sys.modules[module], new)
