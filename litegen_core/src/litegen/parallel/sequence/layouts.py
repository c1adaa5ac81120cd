"""Which ``sp_size x cp_size`` splits one sample over ``G`` ranks, and what each layout costs.

Every layout of the same ``G`` gives each rank the same tokens (``tokens / G``, rounded up), so
the memory of the blocks is the same; they differ in what attention needs and communicates:

- Ulysses (``sp_size``) must divide the heads of every planned attention. Per attention and
  training step, a rank all-to-alls its query, key, value and output and their gradients:
  ``8 x tokens/G x hidden x (sp - 1)/sp`` elements.
- The ring (``cp_size``) has no such limit. A rank passes its key and value chunk
  (``tokens/G x hidden`` each, after Ulysses) ``cp - 1`` times forward and again backward, and
  the key/value gradients ``cp`` times: ``(6 cp - 4) x tokens/G x hidden`` elements, and it
  holds two more chunks (the ones in flight) while attending.

:func:`sequence_layouts` lists the layouts of ``G`` for a model; :func:`recommended` is the one
with the largest Ulysses group the heads allow (all-to-alls within a node move less than the
ring), the rest of ``G`` going to the ring.

Example:
    >>> wan = [AttentionShape("blocks.0.attn1", heads=12, hidden=1536)] * 30
    >>> best = recommended(sequence_layouts(wan, ranks=8, tokens=32760))
    >>> best.sp, best.cp
    (4, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from litegen.parallel.sequence.sequence_plan import matching


@dataclass(frozen=True)
class AttentionShape:
    """One planned attention of a model: its path, heads and hidden size (heads x head_dim)."""

    path: str
    heads: int
    hidden: int


@dataclass(frozen=True)
class Layout:
    """One ``sp x cp`` split of a sample over ``sp * cp`` ranks, and its costs per rank."""

    sp: int
    cp: int
    bad: AttentionShape | None  # an attention whose heads sp does not divide; None: it fits
    tokens_per_rank: int | None  # None when the sequence length is unknown
    ulysses_elements: int | None  # all-to-all elements per training step (forward + backward)
    ring_elements: int | None  # ring elements per training step (forward + backward)

    @property
    def ok(self) -> bool:
        return self.bad is None

    @property
    def problem(self) -> str:
        """Why the model cannot take this layout; "" when it can."""
        if self.bad is None:
            return ""
        return f"sp_size {self.sp} does not divide the {self.bad.heads} heads of {self.bad.path}"


def attention_shapes(model: nn.Module) -> list[AttentionShape]:
    """The attention modules of ``model``'s sequence-parallel plan, with heads and hidden size.

    Example::

        attention_shapes(wan)[0]  # AttentionShape(path='blocks.0.attn1', heads=12, hidden=1536)
    """
    from litegen.parallel.sequence.builtin_plans import plan_for

    shapes = []
    for pattern in plan_for(model).attention:
        for path, module in matching(model, pattern).items():
            heads = getattr(module, "heads", None) or getattr(module, "num_heads", None)
            query = getattr(module, "to_q", None)
            hidden = getattr(module, "inner_dim", None) or getattr(query, "out_features", 0)
            if isinstance(heads, int):
                shapes.append(AttentionShape(path, heads, int(hidden)))
    return shapes


def sequence_layouts(
    shapes: list[AttentionShape], ranks: int, tokens: int | None = None, batch: int = 1
) -> list[Layout]:
    """Every ``sp x cp = ranks`` layout for a model's attention ``shapes``, Ulysses first.

    ``tokens``: the sequence length of one sample; ``batch``: samples per micro-step.

    Example:
        >>> [(l.sp, l.cp, l.ok) for l in sequence_layouts([AttentionShape("a", 12, 768)], 8)]
        [(8, 1, False), (4, 2, True), (2, 4, True), (1, 8, True)]
    """
    layouts = []
    for sp in sorted((d for d in range(1, ranks + 1) if ranks % d == 0), reverse=True):
        cp = ranks // sp
        bad = next((s for s in shapes if s.heads % sp), None)
        local = None if tokens is None else -(-tokens // ranks)
        ulysses = ring = None
        if local is not None:
            hidden = sum(s.hidden for s in shapes)
            ulysses = 8 * batch * local * hidden * (sp - 1) // sp
            ring = (6 * cp - 4) * batch * local * hidden if cp > 1 else 0
        layouts.append(Layout(sp, cp, bad, local, ulysses, ring))
    return layouts


def recommended(layouts: list[Layout]) -> Layout:
    """The layout with the largest Ulysses group the heads allow (the first that works)."""
    return next(layout for layout in layouts if layout.ok)  # sp 1 always works


__all__ = ["AttentionShape", "Layout", "attention_shapes", "recommended", "sequence_layouts"]
