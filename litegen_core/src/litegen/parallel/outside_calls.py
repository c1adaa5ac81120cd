"""Submodules of a sharding unit that the model calls from outside that unit.

FSDP gathers a unit's parameters around the unit's own forward. Some models also run a piece of
a unit from elsewhere: diffusers' DiT calls ``self.transformer_blocks[0].norm1.emb`` in its
top-level forward after the blocks have run, when block 0's parameters are sharded again, and
FSDP1 fails with "mat2 must be a matrix", FSDP2 with "mixed torch.Tensor and DTensor". Such a
submodule becomes a unit of its own, nested in its parent unit: its own hooks then gather its
parameters wherever it is called, inside the block or outside.

Finding them (:func:`called_from_outside`) reads the code, once, before sharding: the source of
each module class's ``forward`` and of the methods it calls on ``self`` is parsed, and every
chain from ``self`` (``self.a.b[0].c``, a name bound to one, a loop variable over a module list)
is resolved against the module tree. A chain that ends strictly inside a unit other than the
caller's own is a call from outside. This costs nothing per step and adds no hook around the
blocks' submodules, so regional ``torch.compile`` of the blocks is unchanged, except that a
block holding a nested unit runs that unit's hooks eagerly (a graph break in that block only).
A detection pass during the first step would need a hook on every submodule and would come
too late to choose the units, which exist before the first step.

What the reading cannot see (a module reached through ``getattr`` with a computed name or by a
function outside the model's classes) still fails at run time; :func:`guard_outside_calls`
turns that failure into a ValueError naming the module and the fix.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

from torch import nn

from litegen.model_parts.paths import is_under

# One step of a chain from ``self``: an attribute, a constant index, or every child (a loop
# variable over a module list, or an index that is not a constant).
Step = tuple[str, Any]
_EACH: Step = ("each", None)


# -- reading the code --------------------------------------------------------------------------
def _chain(node: ast.expr, bound: dict[str, list[Step]]) -> list[Step] | None:
    """The steps of ``self.a[0].b`` (or ``name.b`` for a name bound to a chain); else None."""
    steps: list[Step] = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            steps.append(("attr", node.attr))
        else:
            steps.append(_index(node.slice))
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    if node.id == "self":
        return steps[::-1]
    if node.id in bound:
        return bound[node.id] + steps[::-1]
    return None


def _index(node: ast.expr) -> Step:
    """``[0]``, ``[-1]`` or ``["key"]`` as an index; anything computed could be any child."""
    try:
        return ("index", ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _EACH


def _iterated(node: ast.expr) -> ast.expr:
    """What ``for x in <node>`` walks: the sequence inside ``enumerate(...)`` or ``reversed(...)``."""
    wrapped = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
    if wrapped and node.func.id in ("enumerate", "reversed", "list", "iter"):
        return node.args[0]
    return node


def _bindings(tree: ast.AST) -> dict[str, list[Step]]:
    """Local names bound to a chain: ``x = self.a.b``, ``for blk in self.blocks`` (and enumerate)."""
    bound: dict[str, list[Step]] = {}
    for _ in range(2):  # a second pass resolves names bound through other names
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, chain = node.targets[0], _chain(node.value, bound)
            elif isinstance(node, ast.For):
                target, chain = node.target, _chain(_iterated(node.iter), bound)
                chain = [*chain, _EACH] if chain is not None else None
                if isinstance(target, ast.Tuple) and isinstance(node.iter, ast.Call):
                    target = target.elts[-1]  # for i, blk in enumerate(self.blocks)
            else:
                continue
            if chain is not None and isinstance(target, ast.Name):
                bound[target.id] = chain
    return bound


class _Chains(ast.NodeVisitor):
    """The longest chains from ``self`` in a function, and the ``self`` methods it calls."""

    def __init__(self, bound: dict[str, list[Step]]) -> None:
        self.bound = bound
        self.chains: list[list[Step]] = []
        self.methods: set[str] = set()

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and _is_self(func.value):
            self.methods.add(func.attr)
        self.generic_visit(node)

    def _visit_chain(self, node: ast.Attribute | ast.Subscript) -> None:
        chain = _chain(node, self.bound)
        if chain is not None:
            self.chains.append(chain)
            # Only the longest chain counts (its prefixes are containers on the way), but an
            # index expression may hold chains of its own.
            for inner in ast.walk(node):
                if isinstance(inner, ast.Subscript):
                    self.visit(inner.slice)
        else:
            self.generic_visit(node)

    visit_Attribute = _visit_chain
    visit_Subscript = _visit_chain


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _parse(function: Any) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None  # no source (builtins, generated code): nothing to read


@functools.cache
def _class_chains(cls: type) -> tuple[tuple[Step, ...], ...]:
    """Chains from ``self`` in ``cls.forward`` and in the ``self`` methods it calls, transitively.

    torch.nn's own classes are skipped: their code never reaches into a child's children.
    """
    chains: set[tuple[Step, ...]] = set()
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        function = inspect.getattr_static(cls, name, None)
        function = getattr(function, "__func__", function)  # staticmethod/classmethod
        if not inspect.isfunction(function) or function.__module__.startswith("torch.nn"):
            continue
        tree = _parse(function)
        if tree is None:
            continue
        visitor = _Chains(_bindings(tree))
        visitor.visit(tree)
        chains.update(tuple(chain) for chain in visitor.chains)
        todo.extend(visitor.methods - seen)
    return tuple(chains)


def _resolve(module: nn.Module, chain: tuple[Step, ...]) -> Iterator[nn.Module]:
    """The modules at the end of the longest prefix of ``chain`` that names submodules."""
    current = [module]
    for step in chain:
        following = [child for mod in current for child in _children_at(mod, step)]
        if not following:
            break
        current = following
    yield from current


def _children_at(module: nn.Module, step: Step) -> list[nn.Module]:
    """The submodules one step names: ``.name``, ``[i]``/``["key"]`` of a container, or all."""
    kind, key = step
    children = module._modules
    containers = nn.ModuleList | nn.Sequential | nn.ModuleDict
    if kind == "attr" or (kind == "index" and isinstance(module, nn.ModuleDict)):
        found = children.get(key) if isinstance(key, str) else None
        return [found] if isinstance(found, nn.Module) else []
    if kind == "index" and isinstance(module, nn.ModuleList | nn.Sequential):
        in_range = isinstance(key, int) and -len(module) <= key < len(module)
        return [module[key]] if in_range else []
    if kind == "each" and isinstance(module, containers):
        return [child for child in children.values() if child is not None]
    return []


# -- choosing the extra units ----------------------------------------------------------------
def _owner(path: str, units: set[str]) -> str | None:
    """The innermost unit that holds ``path`` (itself if it is one), None for the root's."""
    holders = [u for u in units if is_under(path, [u])]
    return max(holders, key=len) if holders else None


def called_from_outside(
    model: nn.Module, units: list[str], excluded: Sequence[str] = ()
) -> list[str]:
    """Submodules of ``units`` that the model's code calls from outside their unit.

    Making each of them a unit of its own (sharded before the unit around it) fixes the call;
    that may expose calls into a new unit's own children, so the search repeats until it
    finds nothing new. Modules under ``excluded`` (replicated, frozen) and modules without
    parameters are never a problem and never returned.

    Example::

        called_from_outside(dit, ["transformer_blocks.0", "transformer_blocks.1"])
    """
    modules = dict(model.named_modules())
    path_of = {id(module): path for path, module in modules.items()}
    order = {path: i for i, path in enumerate(modules)}
    chosen = set(units)
    found: set[str] = set()
    while True:
        new = set()
        for caller_path, caller in modules.items():
            caller_owner = _owner(caller_path, chosen)
            for chain in _class_chains(type(caller)):
                for target in _resolve(caller, chain):
                    path = path_of.get(id(target))
                    if path is None or path in chosen or is_under(path, excluded):
                        continue
                    owner = _owner(path, chosen)
                    if owner is not None and owner != caller_owner and _has_params(target):
                        new.add(path)
        if not new:
            return sorted(found, key=order.__getitem__)
        found |= new
        chosen |= new


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


# -- a clear error for what the reading missed -----------------------------------------------
def guard_outside_calls(
    model: nn.Module, units: dict[str, nn.Module], strategy: str, fix: Callable[[str], str]
) -> None:
    """Make ``model``'s forward raise one ValueError when a unit's submodule runs outside it.

    ``units`` maps each unit's path to its module as the model's code sees it (``self`` in its
    forward). The guard is a ``try`` around the root's forward: nothing runs on a step that
    succeeds. On an exception it looks through the traceback for a frame of a module inside a
    unit with no frame of that unit around it, and if it finds one raises a ValueError naming
    it (the outermost such call) and ``fix(path)``, chained to torch's error.

    Example::

        guard_outside_calls(model, {"blocks.0": model.blocks[0]}, "fsdp2", lambda p: "...")
    """
    unit_paths = set(units)
    unit_ids = {id(module): path for path, module in units.items()}
    inside: dict[int, tuple[str, str]] = {}
    for path, module in model.named_modules():
        owner = _owner(path, unit_paths)
        if owner is not None and path != owner and _has_params(module):
            inside[id(module)] = (path, owner)
    if not inside:
        return
    forward = model.forward

    def guarded_forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except Exception as err:
            found = _outside_call(err.__traceback__, inside, unit_ids)
            if found is None:
                raise
            path, owner, caller = found
            raise ValueError(
                f"{strategy}: {path} ran outside its sharding unit {owner} (called from "
                f"{caller}), while that unit's parameters were sharded; LiteGen makes such "
                f"submodules units of their own, but did not find this call in the model's "
                f"code. {fix(path)}"
            ) from err

    model.forward = guarded_forward


def _outside_call(
    tb: TracebackType | None, inside: dict[int, tuple[str, str]], unit_ids: dict[int, str]
) -> tuple[str, str, str] | None:
    """The first (outermost) frame of a module inside a unit whose unit has no frame around it."""
    running: set[str] = set()
    caller = "the model's forward"
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_locals.get("self")
        if isinstance(module, nn.Module):
            if id(module) in unit_ids:
                running.add(unit_ids[id(module)])
            elif id(module) in inside:
                path, owner = inside[id(module)]
                if owner not in running:
                    return path, owner, caller
            if frame.f_code.co_name not in ("_call_impl", "_wrapped_call_impl"):
                caller = frame.f_code.co_qualname
        tb = tb.tb_next
    return None
