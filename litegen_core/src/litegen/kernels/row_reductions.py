"""One-pass (persistent) norms in compiled forwards: ``optimization.compile.persistent_rows``.

Inductor compiles a reduction along rows of at most 1024 elements as a *persistent* Triton
kernel: a program holds its rows in registers, so a LayerNorm reads its input once. Longer rows
get a *looped* kernel that reads them twice, once for the mean and variance and once to
normalise. DiT-XL's hidden size, 1152, sits just past the limit. On one H200, the two forward
norm kernels of workload C's blocks (fused with the residual add and the adaLN modulation)
took 7.1 ms a step looped and 5.3 ms persistent (docs/benchmarks.md). In backward graphs, where
the norm kernels also sum gradients down the columns, persistent kernels measured slower, so
backward graphs keep inductor's choice.

:class:`PersistentRows` is inductor's own heuristics (``InductorChoices``) with that one
threshold raised. :mod:`litegen.compile` installs it only around calls of LiteGen's compiled
blocks, where their forward graphs compile, so other compiled code in the process is unchanged.

Example:
    >>> from torch._inductor.virtualized import V
    >>> with V.set_choices_handler(PersistentRows(2048)):  # doctest: +SKIP
    ...     y = compiled_block(x, c)  # its first call compiles the forward
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import sympy
from torch._inductor import config
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

__all__ = ["PersistentRows"]

# Reductions down columns: one element per row, so a persistent program would hold a column
# strip of many rows; inductor's small limit for them stays.
_COLUMN_HINTS = (ReductionHint.OUTER, ReductionHint.OUTER_TINY)
# A change to this file's heuristics must not be served kernels cached under the old ones.
_SOURCE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


class PersistentRows(InductorChoices):
    """Inductor's choices, with forward row reductions of up to ``limit`` elements persistent.

    Example:
        >>> PersistentRows(2048).limit
        2048
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def cache_key(self) -> str:
        """Names these heuristics (this module's code and the limit) in compile-cache keys.

        Example:
            >>> PersistentRows(2048).cache_key().endswith("-2048")
            True
        """
        return f"litegen.PersistentRows-{_SOURCE_HASH}-{self.limit}"

    def should_use_persistent_reduction(  # type: ignore[override]
        self, features: Any, cooperative_reduction: bool
    ) -> bool:
        numel = features.reduction_numel
        if (
            config.triton.persistent_reductions
            and not cooperative_reduction
            and not V.graph.is_backward
            and features.get_reduction_hint() not in _COLUMN_HINTS
            and isinstance(numel, (int, sympy.Integer))
            and int(numel) <= self.limit
        ):
            return True
        return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)
