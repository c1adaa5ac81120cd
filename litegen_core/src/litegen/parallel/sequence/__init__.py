"""Ulysses sequence parallelism (``optimization.parallel.sp_size``): each sample's sequence is
split over the ranks of a sequence-parallel group, between the blocks of the model.

``prepare`` applies the model's :class:`SequencePlan` (built-in for several diffusers models, or
declared by the model) when ``sp_size > 1``; see ``docs/sequence_parallel.md``.

Example:
    >>> from torch import nn
    >>> class MyDiT(nn.Module):
    ...     litegen_sp_plan = SequencePlan(
    ...         split_inputs={"blocks.0": {"x": 1}},
    ...         gather_outputs={"head": 1},
    ...         attention={"blocks.*.attn": "self"},
    ...     )
    >>> MyDiT.litegen_sp_plan.gather_outputs
    {'head': 1}
"""

from litegen.parallel.sequence.apply import (
    SequenceParallel,
    apply_sequence_parallel,
    compile_context,
    sequence_parallel_off,
)
from litegen.parallel.sequence.plan import SequencePlan, Split
from litegen.parallel.sequence.plans import plan_for, register_sequence_plan

__all__ = [
    "SequenceParallel",
    "SequencePlan",
    "Split",
    "apply_sequence_parallel",
    "compile_context",
    "plan_for",
    "register_sequence_plan",
    "sequence_parallel_off",
]
