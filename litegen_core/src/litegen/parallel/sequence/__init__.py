"""Sequence parallelism: each sample's sequence is split over the ranks of a group, between the
blocks of the model; attention is Ulysses (``optimization.parallel.sp_size``, all-to-alls over
heads) and ring attention (``cp_size``, keys and values passed round), alone or together.

``prepare`` applies the model's :class:`SequencePlan` (built-in for several diffusers models,
declared by the model, or read from a diffusers ``_cp_plan``) when ``sp_size * cp_size > 1``;
see ``docs/sequence_parallel.md``.

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
from litegen.parallel.sequence.builtin_plans import plan_for, register_sequence_plan
from litegen.parallel.sequence.sequence_plan import SequencePlan, Split

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
