"""The layering rules of docs/architecture.md, checked on the source: who may import whom.

Every module of the core sits in one layer of :data:`LAYERS`; it may import modules of its own
layer and of the layers below, never above, and no chain of imports may lead back to where it
started. Imports inside functions count (they run, only later); imports under
``if TYPE_CHECKING:`` never run, so they make no cycle, but they still must not point up.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "litegen_core" / "src" / "litegen"
CLI_COMMANDS = ROOT / "litegen_cli" / "src" / "litegen_cli" / "commands"
# The one door into the lab: prepare opens it, inside a function, when the config asks.
EXPERIMENTAL_DOOR = "runtime/litegen.py"

# Top to bottom; a module belongs to the layer of the longest prefix naming it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("litegen",),  # the package itself: the public API's re-exports
    # The loop around the user's step, and the fine-tuning road that is an entry of it.
    ("litegen.trainer", "litegen.entry", "litegen.finetune"),
    ("litegen.instruments", "litegen.loggers"),  # the loop's instruments
    # The LiteGen object: initialize, prepare, and the checkpointer it holds.
    ("litegen.runtime",),
    ("litegen.experimental",),  # the lab, opened by prepare alone
    (
        "litegen.parallel",
        "litegen.compile",
        "litegen.families",  # what each model family is: the sequence plans read them
    ),  # strategies and compiled blocks, which prepare composes
    (  # the pieces they are made of
        "litegen.memory",
        "litegen.lora",
        "litegen.ema",
        "litegen.optim",
        "litegen.precision",  # dtype casts, FP8 weight storage, FP8 training
        "litegen.flops",  # FLOP counting and the throughput/MFU built on it
        "litegen.checkpoint",
        "litegen.data",
        "litegen.kernels",
        "litegen.cache",
        "litegen.objectives",
        "litegen.pretrained",
    ),
    # Facts about a model's modules.
    (
        "litegen.model_parts",  # repeated blocks, module paths, GELU MLP routing
        "litegen.model_keys",  # the original checkpoints' module names and their converters
    ),
    ("litegen.config", "litegen.utils"),  # the config and the strategy table; no torch
)


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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the import statements under ``if TYPE_CHECKING:``."""
    found = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            found |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return found


def module_imports(path: Path, known: set[str]) -> Iterator[tuple[str, bool]]:
    """``(litegen module imported, only for type checking)`` for each import in ``path``:
    ``from package import name`` is the submodule when ``name`` is one, else the package."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = _type_checking_only(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "litegen" and (module := resolve(target)):
                yield module, id(node) in typing_only


def import_graph() -> dict[str, dict[str, bool]]:
    """Module -> the litegen modules it imports -> whether only for type checking."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, dict[str, bool]] = {}
    for name, path in paths.items():
        edges: dict[str, bool] = {}
        for target, typing_only in module_imports(path, set(paths)):
            if target != name:
                edges[target] = edges.get(target, True) and typing_only
        graph[name] = edges
    return graph


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            exact = prefix == "litegen"  # the package's own layer holds nothing under it
            named = module == prefix or (not exact and module.startswith(prefix + "."))
            if named and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    unplaced = [name for name in import_graph() if layer_of(name) is None]
    assert not unplaced, f"add these modules to LAYERS (and docs/architecture.md): {unplaced}"


def test_folders_equal_layers():
    # A module's folder says its layer: no entry of LAYERS lies inside another entry's folder
    # (the package's own entry holds only litegen/__init__.py).
    entries = [prefix for prefixes in LAYERS for prefix in prefixes if prefix != "litegen"]
    nested = [
        f"{inner} lies inside {outer}"
        for inner in entries
        for outer in entries
        if inner.startswith(outer + ".")
    ]
    assert not nested, nested
    assert len(entries) == len(set(entries)), "an entry is listed twice"


def test_no_module_imports_a_layer_above_its_own():
    offenders = [
        f"{module} imports {target}"
        for module, edges in import_graph().items()
        for target in edges
        if (layer_of(target) or 0) < (layer_of(module) or 0)
    ]
    assert not offenders, offenders


def test_no_import_cycle():
    graph = import_graph()
    running = {m: {t for t, typing_only in e.items() if not typing_only} for m, e in graph.items()}
    assert not cycles(running), cycles(running)


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


def test_the_config_imports_nothing_above_it():
    # The CLI validates recipes with it, without torch; the strategy table lives in it.
    offenders = [
        f"{module} imports {target}"
        for module, edges in import_graph().items()
        if module.startswith("litegen.config")
        for target in edges
        if not target.startswith("litegen.config")
    ]
    assert not offenders, offenders


def test_cli_commands_import_neither_the_app_nor_each_other():
    # app.py registers the commands; what two commands share lives in a module named for what
    # it does, so each command module stays one command and the app imports no cycle.
    offenders = [
        f"commands/{path.name} imports {name}"
        for path in sorted(CLI_COMMANDS.glob("*.py"))
        for name, _ in imports_of(path)
        if name.split(".")[:2] in (["litegen_cli", "app"], ["litegen_cli", "commands"])
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


def test_the_rules_see_a_cycle_and_an_upward_import(tmp_path):
    # A function-level import closes a cycle; one under TYPE_CHECKING does not, but still
    # counts as pointing up.
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from litegen.runtime import x\n"
        "def f():\n    from litegen.config.base import Section\n"
    )
    known = {"litegen.runtime", "litegen.config.base"}
    assert sorted(module_imports(module, known)) == [
        ("litegen.config.base", False),
        ("litegen.runtime", True),
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("litegen.runtime.checkpointer") < layer_of("litegen.parallel.base")
    assert layer_of("litegen.parallel.base") < layer_of("litegen.checkpoint.files")
