"""ZeRO-2: gradients and optimizer state partitioned, parameters replicated.

The same machinery as :mod:`zero1` (bucketed partition, hooks, checkpoints), with one
difference: each gradient bucket is reduce-scattered instead of all-reduced, so after the
backward a rank holds only its partition's averaged gradients; a parameter's full ``.grad``
is dropped as soon as it has been copied into its bucket. The step then updates the partition
and all-gathers the parameters, as ZeRO-1's ``bucketed`` sync does. It reads its options from
``optimization.parallel.zero`` and needs ``parameter_sync: bucketed`` (its row of the
strategy table says so).

Example::

    strategy = Zero2Strategy(plan, config.optimization)
"""

from __future__ import annotations

from typing import ClassVar

from litegen.parallel.zero1 import Zero1Strategy


class Zero2Strategy(Zero1Strategy):
    """ZeRO-1 with reduce-scattered gradients: only the partition's gradients persist."""

    grad_mode: ClassVar[str] = "reduce_scatter"
