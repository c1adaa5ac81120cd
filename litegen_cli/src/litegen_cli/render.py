"""Terminal output for the CLI: config trees, the run shape and error panels (rich only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.tree import Tree

from litegen.checkpoint.layout import STEP_DIR_GLOB
from litegen_cli.failures import EXIT_BAD_INPUT, LaunchFailed, RankFailure
from litegen_cli.recipe import Recipe, RecipeError
from litegen_cli.run_shape import RunShape

console = Console()
err_console = Console(stderr=True)


def _add(tree: Tree, value: Any) -> None:
    if isinstance(value, dict):
        for key, child in value.items():
            if isinstance(child, dict) and child:
                _add(tree.add(f"[bold]{escape(str(key))}[/]"), child)
            else:
                _add_leaf(tree, key, child)
    else:
        tree.add(escape(repr(value)))


def _add_leaf(tree: Tree, key: Any, value: Any) -> None:
    shown = "{}" if value == {} else repr(value) if isinstance(value, str) else str(value)
    tree.add(f"{escape(str(key))}: [cyan]{escape(shown)}[/]")


def config_tree(recipe: Recipe) -> Tree:
    """The resolved recipe (launch + validated config) as a rich tree.

    Example::

        console.print(config_tree(load_recipe("recipes/digits_dit.yaml")))
    """
    tree = Tree(f"[bold]{escape(str(recipe.path))}[/] (resolved)")
    _add(tree, recipe.resolved_dict())
    return tree


def run_shape_table(plan: RunShape) -> Table:
    """The run shape as a two-column table.

    Example::

        console.print(run_shape_table(derive_run_shape(recipe)))
    """
    table = Table(title="Run shape", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("world size", f"{plan.world_size} (nproc_per_node * nnodes)"),
        ("data-parallel size", str(plan.dp_size)),
    ]
    if plan.sp_size > 1 and plan.cp_size == 1:
        rows += [
            ("sequence-parallel size", f"{plan.sp_size} (consecutive ranks share each sample)"),
            ("mesh (dp, sp)", f"({plan.dp_size}, {plan.sp_size})"),
        ]
    elif plan.cp_size > 1:
        shared = plan.sp_size * plan.cp_size
        rows += [
            ("sequence-parallel size", f"{plan.sp_size} (Ulysses all-to-all, consecutive ranks)"),
            ("context-parallel size", f"{plan.cp_size} (ring attention)"),
            ("mesh (dp, cp, sp)", f"({plan.dp_size}, {plan.cp_size}, {plan.sp_size})"),
            ("ranks per sample", f"{shared} (sp * cp)"),
        ]
    rows += [
        ("global batch size", str(plan.global_batch_size)),
        ("grad accumulation steps", str(plan.grad_accum_steps)),
        ("per-rank micro batch", f"{plan.micro_batch} (global / (dp * grad_accum))"),
    ]
    if plan.tokens_per_rank is not None:
        how = (
            "trainer.tokens_per_sample / (sp * cp), rounded up"
            if plan.cp_size > 1
            else "trainer.tokens_per_sample / sp, rounded up"
            if plan.sp_size > 1
            else "per sample"
        )
        rows.append(("tokens per rank", f"{plan.tokens_per_rank} ({how})"))
    rows += [("strategy", plan.strategy), ("device", plan.device), ("memory", plan.memory)]
    rows.append(("weights", plan.weights))
    for name, value in rows:
        table.add_row(name, escape(value))
    return table


def print_recipe_error(err: RecipeError) -> None:
    """Show every problem of a recipe in one red panel on stderr, in MainConfig's format."""
    err_console.print(Panel(escape(str(err)), title="Invalid recipe", border_style="red"))


def print_error(title: str, lines: list[str]) -> None:
    """Show a short error (no traceback) in a red panel on stderr."""
    body = "\n".join(escape(line) for line in lines) or escape(title)
    err_console.print(Panel(body, title=escape(title), border_style="red"))


def print_warnings(lines: list[str]) -> None:
    """Show warnings (e.g. options the strategy ignores) in one yellow panel on stderr."""
    if lines:
        body = "\n".join(f"- {escape(line)}" for line in lines)
        err_console.print(Panel(body, title="Warnings", border_style="yellow"))


def resume_hint(checkpoint_dir: str) -> str:
    """How to continue a failed run: from its latest checkpoint, when it wrote one."""
    if any(Path(checkpoint_dir).glob(STEP_DIR_GLOB)):
        return f"Continue from the latest checkpoint: litegen resume --from {checkpoint_dir}"
    return ""


def report_failure(err: LaunchFailed, resume: str, title: str = "Training failed") -> None:
    """One line for a signal, else one panel: the root failure, the others, where the logs are,
    then ``resume`` (how to go on; not after bad input)."""
    if err.signal is not None:
        line = f"Stopped by {err.signal}; every rank was stopped. {resume}".strip()
        err_console.print(line, highlight=False, markup=False)
        return
    lines = [err.summary]
    if err.failures:
        root, others = err.failures[0], err.failures[1:]
        lines = [f"rank {root.rank}: exit code {root.exitcode}: {root.message}"]
        lines += [f"then rank {f.rank}: exit code {f.exitcode}: {_first_line(f)}" for f in others]
        if root.log:
            lines.append(f"Tracebacks of the failed ranks: {Path(root.log).parent}/")
    if resume and err.exit_code != EXIT_BAD_INPUT:
        lines.append(resume)
    bad_input = err.exit_code == EXIT_BAD_INPUT
    print_error("Bad input" if bad_input else title, lines)


def _first_line(failure: RankFailure) -> str:
    """A failure's message cut to one short line (the root one is shown whole)."""
    line = (failure.message.splitlines() or [""])[0]
    return line if len(line) <= 120 else line[:117] + "..."
