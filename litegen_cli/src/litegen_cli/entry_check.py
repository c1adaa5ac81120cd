"""The entry module's contract, checked before any rank starts and without importing it.

Importing the entry would import torch and the user's models, so ``inspect-config`` and
``launch`` read its source instead (``ast``): the file is found, it parses, every module it
imports at the top is installed or beside it, it defines ``build`` and ``train_step``, and
their signatures take what the training loop passes: ``build(config)`` one positional
argument, ``train_step(batch, ...)`` the batch first, then by keyword only names the loop
supplies. When ``build`` returns a dict written out (``return {"model": ..., ...}``), those
keys are the names ``train_step`` and the hooks may ask for; otherwise the names are not
checked. What the ranks would see differently (a name made at import time, a ``from x import
*``) is left to them: they check again after importing.

Example:
    >>> _ = Path("entry.py").write_text("def build(config): ...\\ndef train_step(batch): ...\\n")
    >>> entry_problems("entry.py", Path("."))
    []
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any

FIX = (
    "an entry module defines build(config) -> dict of the objects to prepare, and "
    "train_step(batch, ...) -> loss (docs/cli.md)"
)
# What the loop passes by keyword besides build()'s names (litegen.trainer.hooks).
LOOP_NAMES = {"gen", "config", "step"}
HOOK_NAMES = {"train_step": LOOP_NAMES, "sample": LOOP_NAMES | {"out_dir"}}


def entry_problems(entry: str, base_dir: Path) -> list[str]:
    """Every problem of the entry module ``entry`` (a ``.py`` path or a module name), one line
    each, naming the file and the fix; [] when it is fine or cannot be read without importing."""
    path, problem = locate_entry(entry, base_dir)
    if problem:
        return [problem]
    if path is None:  # installed in a form we cannot read (an extension, a zip): ranks check
        return []
    where = f"field 'launch.entry': entry file '{path}'"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as err:
        return [f"{where} is not valid Python (line {err.lineno}: {err.msg}); fix the syntax"]
    except (OSError, UnicodeDecodeError) as err:
        return [f"{where} cannot be read ({err}); check the file"]
    problems = [f"{where} {p}" for p in _import_problems(tree, path.parent, base_dir)]
    defined, functions, star = _top_level_names(tree)
    missing = [name for name in ("build", "train_step") if name not in defined]
    if missing and not star:
        problems.append(f"{where} does not define {' and '.join(missing)}; {FIX}")
    keys = _build_keys(functions.get("build"))
    for name, fn in functions.items():
        problem = _signature_problem(name, fn, keys)
        if problem:
            problems.append(f"{where}: {problem}")
    return problems


def input_problems(entry: str, base_dir: Path, config: Any) -> list[str]:
    """What the entry's optional ``check_inputs(config)`` hook refuses (a missing folder or
    file), as problem lines, before any rank starts; [] when it passes or is not defined.

    Only an entry whose source defines the hook is imported here, so other entries start as
    fast as before. The hook raises ``ValueError`` naming the path and the fix.

    Example:
        >>> input_problems("digits_dit.py", Path("recipes"), config=None)  # defines no hook
        []
    """
    path, problem = locate_entry(entry, base_dir)
    if problem or path is None:
        return []
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, OSError, UnicodeDecodeError):
        return []  # entry_problems reports it
    if "check_inputs" not in _top_level_names(tree)[0]:
        return []
    from litegen.entry import check_inputs  # imports torch and the entry's own imports

    try:
        check_inputs(config, entry, base_dir)
    except ValueError as err:
        return [str(err)]
    return []


def locate_entry(entry: str, base_dir: Path) -> tuple[Path | None, str | None]:
    """The entry's source file, or the problem line when it cannot be found.

    Same rule as ``litegen.entry.load_entry``: a ``.py`` suffix means a file path (relative to
    the recipe folder), anything else a module name looked up in the recipe folder, the current
    folder, then the installed packages, without importing any of them.
    """
    if entry.endswith(".py"):
        path = Path(entry).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if path.is_file():
            return path, None
        return None, (
            f"field 'launch.entry': entry file '{path}' does not exist; give a .py path "
            f"relative to the recipe folder '{base_dir}' or a module name like pkg.module"
        )
    parts = entry.split(".")
    roots = [base_dir, Path.cwd()]
    # Only the top-level package is looked up: find_spec("a.b") would import package `a`.
    spec = importlib.util.find_spec(parts[0]) if not _local(parts[0], roots) else None
    if spec is not None:
        if spec.submodule_search_locations is None:  # a plain module: a.b cannot be inside
            origin = Path(spec.origin) if spec.origin else None
            readable = len(parts) == 1 and origin is not None and origin.suffix == ".py"
            return (origin if readable else None), None
        roots = [Path(p).parent for p in spec.submodule_search_locations]
    for root in roots:
        base = root.joinpath(*parts)
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path, None
    if spec is not None or _local(parts[0], [base_dir, Path.cwd()]):
        return None, None  # the package exists; its module may be made at import time
    return None, (
        f"field 'launch.entry': module '{entry}' not found; '{parts[0]}' is neither in the recipe "
        f"folder '{base_dir}', the current folder nor installed (or give a .py path)"
    )


def _local(top: str, roots: list[Path]) -> bool:
    return any((root / f"{top}.py").is_file() or (root / top).is_dir() for root in roots)


def _import_problems(tree: ast.Module, folder: Path, base_dir: Path) -> list[str]:
    """Top-level imports (outside ``try``) of packages that are neither installed nor local."""
    tops = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            tops += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.append(node.module.split(".")[0])
    problems = []
    for top in dict.fromkeys(tops):
        if top in sys.stdlib_module_names or _local(top, [folder, base_dir, Path.cwd()]):
            continue
        if importlib.util.find_spec(top) is None:
            problems.append(
                f"imports '{top}', which is not installed; install it in this environment "
                "(uv add, pip install) or fix the import"
            )
    return problems


def _top_level_names(tree: ast.Module) -> tuple[set[str], dict[str, ast.FunctionDef], bool]:
    """Names bound at the top (defs, assignments, imports), the functions among them, and
    whether a ``from x import *`` may bind more."""
    names: set[str] = set()
    functions: dict[str, ast.FunctionDef] = {}
    star = False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            star = star or any(alias.name == "*" for alias in node.names)
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:  # if/try blocks: names bound inside count as defined, unchecked
            names |= {
                n.name
                for n in ast.walk(node)
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            }
    for name in set(functions) - {"build", "train_step", "sample", "validate", "finish"}:
        functions.pop(name)
    return names, functions, star


def _build_keys(build: ast.FunctionDef | None) -> set[str] | None:
    """The keys of build()'s returned dict when every ``return`` writes it out, else None."""
    if build is None:
        return None
    returns = [n for n in ast.walk(build) if isinstance(n, ast.Return)]
    keys: set[str] = set()
    for node in returns:
        if not isinstance(node.value, ast.Dict):
            return None
        for key in node.value.keys:
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                return None  # a computed key or a ``**other`` merge
            keys.add(key.value)
    return keys or None


def _signature_problem(name: str, fn: ast.FunctionDef, keys: set[str] | None) -> str | None:
    """What the loop's call of ``fn`` would raise a TypeError for, in words, or None."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    required = positional[: len(positional) - len(args.defaults)]
    kw_required = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if not d]
    if name == "build":
        if (not positional and args.vararg is None) or len(required) > 1 or kw_required:
            return f"build must take the config as its one argument: def build(config): ...; {FIX}"
        return None
    if name == "train_step" and not positional and args.vararg is None:
        return (
            "train_step must take the batch as its first argument: "
            f"def train_step(batch, model, ...): ...; {FIX}"
        )
    if args.posonlyargs[1 if name == "train_step" else 0 :]:
        return f"{name} receives its arguments by keyword; remove the '/' from its signature"
    wanted = [a.arg for a in required[1 if name == "train_step" else 0 :]] + kw_required
    if keys is None or args.kwarg is not None:
        return None
    offered = keys | HOOK_NAMES.get(name, LOOP_NAMES)
    unknown = [w for w in wanted if w not in offered]
    if not unknown:
        return None
    return (
        f"{name} asks for {', '.join(repr(u) for u in unknown)}, which neither build() returns "
        f"nor the loop passes (build() returns {', '.join(sorted(keys))}; the loop adds "
        f"{', '.join(sorted(HOOK_NAMES.get(name, LOOP_NAMES)))}); rename the parameter, give "
        "it a default, or return it from build()"
    )


__all__ = ["entry_problems", "locate_entry"]
