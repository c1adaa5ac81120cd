"""Sequence-parallel plans: where a model's sequence is split, where it is gathered, and which
attention modules see split tokens.

A plan names modules by their dotted paths (``model.named_modules()``); attention paths may use
``*`` for one path component (``"blocks.*.attn1"``). Everything the plan does not split stays
whole on every rank: timestep and text conditioning, pooled embeddings, masks over text.

Example (a DiT whose blocks take ``x`` and whose ``head`` produces the output)::

    class MyDiT(nn.Module):
        litegen_sp_plan = SequencePlan(
            split_inputs={"blocks.0": {"x": 1}},   # blocks.0's argument x, along dim 1
            gather_outputs={"head": 1},            # head's output, gathered along dim 1
            attention={"blocks.*.attn": "self"},   # F.scaled_dot_product_attention inside
        )

A model gets its plan from, in order: a plan registered for its class
(:func:`litegen.parallel.sequence.builtin_plans.register_sequence_plan`), its ``litegen_sp_plan``
attribute (a plan, or a method returning one, for plans that depend on the model's
configuration), LiteGen's built-in plans (:mod:`litegen.parallel.sequence.builtin_plans`, which
looks them up: ``plan_for``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

# How the split tokens sit in an attention call's sequence (see attention.py):
#   self:       query, key and value are all split tokens (self-attention over the video);
#   text_first: text tokens (whole on every rank) first, then the split tokens (joint attention);
#   text_last:  the split tokens first, then the text tokens.
# Cross-attention (split queries, whole text keys and values) needs no entry and no
# communication: each rank's queries attend to the whole text.
AttentionLayout = Literal["self", "text_first", "text_last"]
LAYOUTS: tuple[str, ...] = ("self", "text_first", "text_last")

PLAN_ATTRIBUTE = "litegen_sp_plan"


@dataclass(frozen=True)
class Split:
    """Split a tensor along ``dim``; with ``ndim``, only tensors of that many dimensions.

    A tensor whose size along ``dim`` is 1 broadcasts over the sequence and stays whole.

    Example:
        >>> Split(1, ndim=2)  # a per-token timestep (B, S) is split; a per-sample one (B,) is not
        Split(dim=1, ndim=2)
    """

    dim: int
    ndim: int | None = None


@dataclass(frozen=True)
class SequencePlan:
    """Where one model's sequence is split and gathered (module docstring).

    ``split_inputs``: module path -> {forward argument name or position: dim or Split}; a
    tuple or list argument (cos and sin of a rotary embedding) has each tensor split.
    ``split_outputs``: module path -> {output index: dim or Split} (index 0 for a single
    tensor), for modules that compute something over the whole sequence, such as a rotary
    embedding. ``gather_outputs``: module path -> dim: its output is gathered from the ranks.
    ``attention``: module path pattern -> :data:`AttentionLayout`.

    Example:
        >>> SequencePlan(split_inputs={"blocks.0": {"hidden_states": 1}},
        ...              gather_outputs={"proj_out": 1}, attention={"blocks.*.attn1": "self"})
        SequencePlan(split_inputs={'blocks.0': {'hidden_states': 1}}, split_outputs={},
                     gather_outputs={'proj_out': 1}, attention={'blocks.*.attn1': 'self'})
    """

    split_inputs: Mapping[str, Mapping[str | int, int | Split]] = field(default_factory=dict)
    split_outputs: Mapping[str, Mapping[int, int | Split]] = field(default_factory=dict)
    gather_outputs: Mapping[str, int] = field(default_factory=dict)
    attention: Mapping[str, str] = field(default_factory=dict)

    def check(self, model: nn.Module) -> None:
        """Raise ``ValueError`` naming what does not fit ``model``."""
        name = type(model).__name__
        if not (self.split_inputs or self.split_outputs) or not self.gather_outputs:
            raise ValueError(
                f"the sequence-parallel plan of {name} must split something (split_inputs or "
                "split_outputs) and gather the output (gather_outputs)."
            )
        modules = dict(model.named_modules())
        for kind in ("split_inputs", "split_outputs", "gather_outputs"):
            for path in getattr(self, kind):
                if path not in modules:
                    raise ValueError(
                        f"the sequence-parallel plan of {name} names {path!r} in {kind}, which "
                        f"is not a module of the model; use a path from model.named_modules()."
                    )
        for pattern, layout in self.attention.items():
            if layout not in LAYOUTS:
                raise ValueError(
                    f"the sequence-parallel plan of {name} gives attention {pattern!r} the "
                    f"layout {layout!r}; use one of {', '.join(LAYOUTS)}."
                )
            if not matching(model, pattern):
                raise ValueError(
                    f"the sequence-parallel plan of {name}: the attention pattern {pattern!r} "
                    "matches no module; use dotted paths with * for one component "
                    "(e.g. 'blocks.*.attn1')."
                )


def as_split(spec: int | Split) -> Split:
    return spec if isinstance(spec, Split) else Split(spec)


def matching(model: nn.Module, pattern: str) -> dict[str, nn.Module]:
    """The submodules whose path matches ``pattern`` (``*`` stands for one path component).

    Example:
        >>> wan = nn.Module()
        >>> wan.blocks = nn.ModuleList(
        ...     nn.ModuleDict({"attn1": nn.Linear(4, 4), "attn2": nn.Linear(4, 4)}) for _ in range(2)
        ... )
        >>> list(matching(wan, "blocks.*.attn1"))
        ['blocks.0.attn1', 'blocks.1.attn1']
    """
    regex = re.compile(
        "\\.".join("[^.]+" if p == "*" else re.escape(p) for p in pattern.split("."))
    )
    return {path: m for path, m in model.named_modules() if path and regex.fullmatch(path)}


__all__ = [
    "LAYOUTS",
    "PLAN_ATTRIBUTE",
    "AttentionLayout",
    "SequencePlan",
    "Split",
    "as_split",
    "matching",
]
