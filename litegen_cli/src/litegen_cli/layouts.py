"""`litegen inspect-config RECIPE --estimate`'s sequence layouts: how one sample's sequence can be
split over its ranks as ``sp_size`` (Ulysses) x ``cp_size`` (ring), for the trained model built
on meta (:func:`litegen.parallel.sequence.layouts.sequence_layouts` has the arithmetic).

The ranks are the recipe's ``sp_size * cp_size`` when above 1, else every rank of the job (how
one sample could be spread over all of them). A recipe whose ``sp_size`` does not divide the
model's heads is bad input: the message names the layout to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from litegen_cli.recipe import Recipe
from litegen_cli.run_shape import derive_run_shape

MIB = 2**20
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LayoutReport:
    """The layouts of one model over ``ranks`` ranks, the recipe's and the recommended one."""

    model: str
    ranks: int
    tokens: int | None
    element_bytes: int
    layouts: list[Any]
    chosen: tuple[int, int]  # the recipe's (sp_size, cp_size)
    recommended: Any  # None when the model has no sequence plan
    problem: str  # the recipe's layout does not fit the model; "" when it does


def layout_report(model: Any, recipe: Recipe) -> LayoutReport | None:
    """The layouts of ``model`` for ``recipe``; None when the model has no sequence plan and
    the recipe does not split the sequence (a report with only the problem when it does).

    Example::

        report = layout_report(wan_on_meta, load_recipe("scripts/bench/sp_dry_run.yaml"))
        report.recommended.sp, report.recommended.cp
    """
    from litegen.parallel.sequence.layouts import attention_shapes, recommended, sequence_layouts

    config = recipe.config
    parallel = config.optimization.parallel
    chosen = (parallel.sp_size, parallel.cp_size)
    plan = derive_run_shape(recipe)
    ranks = chosen[0] * chosen[1] if chosen != (1, 1) else plan.world_size
    try:
        shapes = attention_shapes(model)
    except ValueError as err:  # no plan: prepare would refuse sp/cp > 1 with this message
        if chosen == (1, 1):
            return None
        problem = str(err).rstrip(".")
        return LayoutReport(type(model).__name__, ranks, None, 4, [], chosen, None, problem)
    if ranks == 1 or not shapes:
        return None
    tokens = config.trainer.tokens_per_sample
    cast = config.optimization.precision.cast_model
    layouts = sequence_layouts(shapes, ranks, tokens, batch=plan.micro_batch)
    best = recommended(layouts)
    mine = next((layout for layout in layouts if (layout.sp, layout.cp) == chosen), None)
    problem = ""
    if mine is not None and not mine.ok:
        problem = (
            f"field 'optimization.parallel.sp_size': {mine.problem} of "
            f"{type(model).__name__}; use sp_size: {best.sp}, cp_size: {best.cp} (Ulysses "
            f"{best.sp} x ring {best.cp} over the same {ranks} ranks)"
        )
    return LayoutReport(
        model=type(model).__name__,
        ranks=ranks,
        tokens=tokens,
        element_bytes=DTYPE_BYTES.get(str(cast), 4),
        layouts=layouts,
        chosen=chosen,
        recommended=best,
        problem=problem,
    )


def layouts_table(report: LayoutReport) -> Table:
    """The layouts as a table: heads, tokens per rank, communication per step and rank.

    Example::

        console.print(layouts_table(report))
    """
    title = f"Sequence layouts of {report.model} over {report.ranks} ranks per sample"
    table = Table(title=title, title_justify="left")
    for column in ("sp_size x cp_size", "heads", "tokens per rank"):
        table.add_column(column)
    table.add_column("all-to-all MiB/step", justify="right")
    table.add_column("ring MiB/step", justify="right")
    table.add_column("")

    def mib(elements: int | None) -> str:
        return "-" if elements is None else f"{elements * report.element_bytes / MIB:,.0f}"

    for layout in report.layouts:
        notes = []
        if (layout.sp, layout.cp) == report.chosen:
            notes.append("the recipe's")
        if layout is report.recommended:
            notes.append("recommended")
        table.add_row(
            f"{layout.sp} x {layout.cp}",
            "divide" if layout.ok else f"{layout.bad.heads}: not divisible",
            "-" if layout.tokens_per_rank is None else str(layout.tokens_per_rank),
            mib(layout.ulysses_elements),
            mib(layout.ring_elements),
            ", ".join(notes),
        )
    if report.tokens is None:
        table.caption = "set trainer.tokens_per_sample for tokens and communication"
    return table


__all__ = ["LayoutReport", "layout_report", "layouts_table"]
