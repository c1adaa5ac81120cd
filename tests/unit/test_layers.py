"""The layering rules of docs/architecture.md, checked on the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "litegen_core" / "src" / "litegen"
# The one door into the lab: prepare opens it, inside a function, when the config asks.
EXPERIMENTAL_DOOR = "runtime/litegen.py"


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import statement in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(name, id(node) in top_level) for name in [node.module, *names]]
    return found


def modules_under(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def test_the_core_never_imports_experimental_code():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("experimental/"):
            continue
        for name, top_level in imports_of(path):
            if not name.startswith("litegen.experimental"):
                continue
            if relative == EXPERIMENTAL_DOOR and not top_level:
                continue
            offenders.append(f"{relative} imports {name}")
    assert not offenders, offenders


def test_memory_and_parallel_do_not_import_each_other():
    pairs = (("memory", "litegen.parallel"), ("parallel", "litegen.memory"))
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for folder, forbidden in pairs
        for path in modules_under(folder)
        for name, _ in imports_of(path)
        if name.startswith(forbidden)
    ]
    assert not offenders, offenders


def test_the_rules_see_an_offending_import(tmp_path):
    # The checks above read real import statements, at any depth, both spellings.
    module = tmp_path / "m.py"
    module.write_text(
        "import litegen.parallel\ndef f():\n    from litegen.experimental import Lab\n"
    )
    assert imports_of(module) == [
        ("litegen.parallel", True),
        ("litegen.experimental", False),
        ("litegen.experimental.Lab", False),
    ]
