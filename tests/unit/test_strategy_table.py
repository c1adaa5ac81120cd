"""The strategy table is the one declaration: the registry, the config, the docs and the rules
read it, and nothing else names a strategy."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest

from litegen.config import MainConfig, ParallelConfig
from litegen.config.strategies import (
    STRATEGIES,
    STRATEGY_OPTIONS,
    TABLE,
    StrategyRow,
    job_shape_problems,
    requirement_problems,
)

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "litegen_core" / "src" / "litegen"
TABLE_MODULE = CORE / "config" / "strategies.py"


def docs_line(row: StrategyRow) -> str:
    """The row of docs/strategies.md's table for ``row``."""
    options = ", ".join(f"`{option}`" for option in row.options) or "none"
    cells = [
        f"`{row.name}`",
        f"`{row.implementation}`",
        ", ".join(row.shards) or "nothing",
        "yes" if row.master_weights else "no",
        row.ema,
        options,
        "yes" if row.sequence_parallel else "no",
        f"{row.min_nodes} or more",
    ]
    return "| " + " | ".join(cells) + " |"


def test_the_docs_table_lists_the_table_rows():
    text = (ROOT / "docs" / "strategies.md").read_text(encoding="utf-8")
    listed = [line for line in text.splitlines() if re.match(r"\| `\w+` \| `litegen\.", line)]
    assert listed == [docs_line(row) for row in TABLE]


def test_the_config_accepts_exactly_the_table_names():
    field = ParallelConfig.model_fields["strategy"]
    assert get_args(field.annotation) == tuple(STRATEGIES)
    assert field.default == TABLE[0].name


@pytest.mark.parametrize("row", TABLE, ids=lambda row: row.name)
def test_each_row_names_a_strategy_class_that_reads_its_facts(row):
    import torch

    from litegen.parallel import build_strategy, strategy_class
    from litegen.parallel.base import Strategy
    from litegen.parallel.plan import ParallelPlan

    cls = strategy_class(row.name)
    assert issubclass(cls, Strategy)
    nodes = row.min_nodes
    plan = ParallelPlan(row.name, torch.device("cpu"), 2 * nodes, 0, nodes, 2)
    strategy = build_strategy(plan, MainConfig().optimization)
    assert isinstance(strategy, cls) and strategy.name == row.name
    assert strategy.master_weights == row.master_weights
    assert strategy.ema_from_copy == (row.ema == "wrapped copy")
    assert strategy.shards_parameters == ("parameters" in row.shards)


def test_options_a_strategy_ignores_come_from_the_rows():
    for option, readers in STRATEGY_OPTIONS.items():
        assert 0 < len(readers) < len(TABLE), option
        assert readers == tuple(row.name for row in TABLE if option in row.reads)
    assert STRATEGY_OPTIONS["optimization.optimizer.fp32_master_weights"] == tuple(
        row.name for row in TABLE if row.master_weights
    )


def test_job_shape_rules_name_the_field_and_the_fix():
    assert job_shape_problems(world_size=4, nnodes=1, strategy=TABLE[0].name, sp_size=2) == []
    assert job_shape_problems(world_size=8, nnodes=1, sp_size=4, cp_size=2) == []
    (sp,) = job_shape_problems(world_size=3, nnodes=1, sp_size=2)
    assert str(sp).startswith("field 'optimization.parallel.sp_size': 2 does not divide")
    # sp divides the world, sp * cp does not: cp is the field to change.
    (cp,) = job_shape_problems(world_size=6, nnodes=1, sp_size=2, cp_size=2)
    assert (cp.field, cp.error) == ("optimization.parallel.cp_size", ValueError)
    assert "sp_size 2 * cp_size 2 = 4 does not divide the world size 6" in cp.text
    (both,) = job_shape_problems(world_size=3, nnodes=1, sp_size=2, cp_size=2)
    assert both.field == "optimization.parallel.sp_size"
    for row in TABLE:
        enough = job_shape_problems(world_size=4, nnodes=row.min_nodes, strategy=row.name)
        assert enough == []
        if row.min_nodes > 1:
            (short,) = job_shape_problems(world_size=4, nnodes=1, strategy=row.name)
            assert short.field == "optimization.parallel.strategy"
            assert f"'{row.one_node}' on one node" in short.text


def test_requirements_of_a_strategy_name_its_option():
    # The defaults meet every strategy's requirements; a value that does not is named.
    assert all(requirement_problems(MainConfig().optimization, row.name) == [] for row in TABLE)
    zero2 = MainConfig.from_dict(
        {"optimization": {"parallel": {"strategy": "zero2", "zero": {"parameter_sync": "native"}}}}
    ).optimization
    (problem,) = requirement_problems(zero2, where="optimization.profiles.p")
    assert str(problem).startswith(
        "field 'optimization.profiles.p.parallel.zero.parameter_sync': zero2 needs 'bucketed'"
    )


def string_literals(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, value)`` of every string constant in ``path`` but docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    for node in ast.walk(tree):
        is_string = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_string and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_strategy_name_is_spelled_outside_the_table():
    # A string literal that is exactly a strategy's name, anywhere in the core and the CLI
    # but the table.
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {value!r}"
        for path in [*CORE.rglob("*.py"), *(ROOT / "litegen_cli" / "src").rglob("*.py")]
        if path != TABLE_MODULE
        for line, value in string_literals(path)
        if value in STRATEGIES
    ]
    assert not offenders, offenders


def test_the_name_check_sees_a_literal(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Docs name \'ddp\'."""\nSTRATEGY = "ddp"\n')
    assert [value for _, value in string_literals(module) if value in STRATEGIES] == ["ddp"]


def test_strategy_modules_import_no_other_strategy_but_their_base_class():
    # Strategies are plugins: shared code lives in parallel/base.py (or lower), and a strategy
    # module imports another only to subclass its strategy (zero2 is ZeRO-1 with one change).
    from litegen.parallel import strategy_class
    from tests.unit.test_layers import PACKAGE, module_imports, module_name

    modules = {row.implementation.partition(":")[0] for row in TABLE}
    known = {module_name(path) for path in PACKAGE.rglob("*.py")}
    classes = {m: [strategy_class(r.name) for r in TABLE if r.implementation.startswith(m + ":")]
               for m in modules}  # fmt: skip
    offenders = []
    for module in sorted(modules):
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        for target, _ in module_imports(path, known):
            if target in modules and target != module:
                bases = classes[target]
                if not any(issubclass(c, b) for c in classes[module] for b in bases):
                    offenders.append(f"{module} imports {target}")
    assert not offenders, offenders
