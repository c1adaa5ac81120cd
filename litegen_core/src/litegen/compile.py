"""Regional compilation: ``torch.compile`` each repeated block of a model, in place.

``prepare`` calls :func:`compile_blocks` after activation checkpointing and before the strategy
wraps (or shards) the model, the order torchtitan uses, so every strategy gets the same
compiled blocks.

Why blocks and not the whole model: the blocks of a DiT share one ``forward``, so Dynamo traces
it once and every block reuses the graph (compile time of one block, not of 28), and graph breaks
outside the blocks (data-dependent code in the user's top-level ``forward``) cost nothing.

Why ``block.forward`` and not ``block.compile()``: ``Module.compile`` compiles ``_call_impl``,
which runs the module's hooks inside the compiled region. FSDP's all-gather hooks are
Dynamo-disabled, so they would split every block's graph in two. Compiling the instance's
``forward`` keeps the hooks eager around the compiled region (torchtitan's layout), and since no
wrapper module is inserted, ``state_dict`` keys and parameter objects stay the user's (no
``_orig_mod.`` prefix).

A block that activation checkpointing or offload manages has a
:class:`litegen.memory.block_forward.BlockForward` as its ``forward``; it is compiled from
inside (:meth:`~litegen.memory.block_forward.BlockForward.compile`): its plain forward, and with
``inside_compile`` its checkpointed forward too, each become a compiled callable, while the
offloader's saved-tensor hooks stay eager around them (hooks entered inside a compiled region
would break its graph). So each mode has its graph, and the budget planner can switch a
block's mode without a recompile.

``dynamic``: ``None`` lets Dynamo compile the first shape static and, at the first new shape,
recompile once with dynamic sizes (at most two compiles per block for any number of
resolutions); ``True`` compiles dynamic from the start; ``False`` specialises on every shape, so
variable resolutions recompile until ``torch._dynamo.config.recompile_limit`` (8) and then run
eagerly: use it only for fixed shapes.

``block_contexts``: contexts entered around every call of a compiled block (where its graphs
compile on the first call and on recompiles), for settings that must reach only LiteGen's blocks;
sequence parallelism (:func:`litegen.parallel.sequence.compile_context`) and the experimental
kernels (:mod:`litegen.experimental`) use it.

``memory_budget`` (activation checkpointing's ``memory_budget`` policy): AOTAutograd's min-cut
partitioner decides, when it splits a compiled block into forward and backward, which
activations to save and which to recompute. Below 1 it solves a knapsack over the block's ops:
keep the saved bytes within the budget while recomputing what its runtime estimate (FLOP
counts) calls cheapest. 0 saves the least it can, 1 what it saves by default. The budget is
set around each call of a compiled block, where that split happens, rather than process-wide,
so code outside LiteGen's blocks compiles as usual.

Mix-order reduction: inductor's ``triton.mix_order_reduction`` (on by default on CUDA since torch
2.10) fuses a norm's per-row reductions with its per-column ones. When the column reductions are
gradients of slices of one tensor, as in ``(scale_shift_table + temb).chunk(6)`` of Wan and other
adaLN DiTs, the fused kernel never writes those slices, and the block returns uninitialised
memory as their gradient (torch 2.10 to 2.13 at least; diffusers' Wan 2.1 diverges within a few
hundred steps). So LiteGen compiles with it off. The backward compiles lazily, outside any
context around the forward call, so the setting travels in ``torch.compile``'s ``options``; as
torch takes a ``mode`` or ``options`` but not both, a ``mode`` is passed as the options it
stands for (``torch._inductor.list_mode_options``). ``TORCHINDUCTOR_MIX_ORDER_REDUCTION=1`` in
the environment, or ``triton: {mix_order_reduction: true}`` in ``optimization.compile.options``,
turns it back on.

DDP: under ``DistributedDataParallel`` Dynamo's DDPOptimizer splits every compiled graph at
gradient-bucket boundaries (25 MB), so that all-reduces can start while the rest of the graph's
backward runs. A DiT block holds about 4 buckets of parameters, so each block would become
about 4 graphs: no fusion across the cuts, the block input's gradient summed eagerly, and more
kernel launches. Compiled *blocks* need no split, since each block's backward is its own
autograd node and DDP already all-reduces block by block while the next block's backward runs.
So LiteGen's blocks compile with ``optimize_ddp`` off, again set around each call (under DDP
only) rather than process-wide. A model compiled whole (no repeated blocks) keeps the split:
its backward is one autograd node, and only the split lets its all-reduces overlap it.

Example:
    >>> from litegen.config.sections import CompileConfig
    >>> dit = nn.Module()
    >>> dit.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(4))
    >>> compile_blocks(dit, CompileConfig(enabled=True, dynamic=None))  # compiled at first call
    ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from litegen.flops.counting import call_compiled
from litegen.memory.block_forward import block_forward
from litegen.model_parts.blocks import repeated_blocks

log = logging.getLogger("litegen")


class _CompiledForward:
    """Marks a compiled ``forward`` so a second ``prepare`` never compiles a block twice."""

    def __init__(
        self,
        original: Callable,
        compiled: Callable,
        patched: bool,
        memory_budget: float | None = None,
        is_block: bool = True,
        block_contexts: Sequence[Callable[[], AbstractContextManager]] = (),
    ) -> None:
        self.original = original  # what ``forward`` was: the class's or an instance patch
        self.compiled = compiled
        self.patched = patched  # whether ``original`` was set on the instance
        self.memory_budget = memory_budget
        # A block's backward is its own autograd node; a whole model's is not (module docstring).
        self.is_block = is_block
        self.block_contexts = tuple(block_contexts)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # These settings are read while Dynamo, AOTAutograd and inductor compile the block, which
        # happens inside this call on its first run and on every recompile (module docstring).
        # Each is set only where it applies, so that elsewhere the call stays plain for an outer
        # ``torch.compile``.
        with ExitStack() as settings:
            if self.is_block and DistributedDataParallel._get_active_ddp_module() is not None:
                settings.enter_context(torch._dynamo.config.patch(optimize_ddp=False))
            if self.memory_budget is not None:
                budget = {"activation_memory_budget": self.memory_budget}
                settings.enter_context(torch._functorch.config.patch(**budget))
            for context in self.block_contexts:
                settings.enter_context(context())
            # While the first step's FLOPs are counted, this runs compiled and counts the eager
            # forward on fake tensors (litegen/flops/counting.py).
            return call_compiled(self.compiled, self.original, args, kwargs)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled this module's ``forward``."""
    managed = block_forward(module)
    if managed is not None:
        return managed.compiled
    return isinstance(module.__dict__.get("forward"), _CompiledForward)


def inductor_options(options: dict[str, Any]) -> dict[str, Any]:
    """``optimization.compile.options`` with YAML's nested sections as inductor's dotted names.

    ``{triton: {tile_reductions: true}}`` becomes ``{"triton.tile_reductions": True}``, the name
    ``torch.compile(options=...)`` takes; an option whose value is itself a dict (say
    ``post_grad_fusion_options``) is kept whole.

    Example:
        >>> inductor_options({"triton": {"tile_reductions": True}, "max_autotune_gemm": False})
        {'triton.tile_reductions': True, 'max_autotune_gemm': False}
    """
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()

    def flatten(section: dict[str, Any], prefix: str) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for key, value in section.items():
            name = prefix + key
            if isinstance(value, dict) and name not in known:
                flat.update(flatten(value, f"{name}."))
            else:
                flat[name] = value
        return flat

    return flatten(options, "")


def correct_gradient_options() -> dict[str, Any]:
    """Inductor options that compiled regions need for correct gradients (module docstring).

    Example::

        torch.compile(block.forward, options=correct_gradient_options())  # a hand-written loop
    """
    from torch._inductor import config as inductor_config

    if not hasattr(inductor_config.triton, "mix_order_reduction"):
        return {}
    if "TORCHINDUCTOR_MIX_ORDER_REDUCTION" in os.environ:  # the user's explicit choice
        return {}
    return {"triton.mix_order_reduction": False}


def compile_kwargs(compile_cfg: Any, backend: str | Callable | None = None) -> dict[str, Any]:
    """The ``torch.compile`` keyword arguments for an ``optimization.compile`` section.

    With inductor, the mode becomes the options it stands for, merged with LiteGen's
    correctness options and then the user's (module docstring).

    Example:
        >>> from litegen.config.sections import CompileConfig
        >>> compile_kwargs(CompileConfig(enabled=True, mode="max-autotune-no-cudagraphs"))
        {'dynamic': False, 'options': {'max_autotune': True, 'coordinate_descent_tuning': True,
         'triton.mix_order_reduction': False}}
    """
    inductor = backend in (None, "inductor")
    if compile_cfg.mode != "default" and not inductor:
        raise ValueError(
            f"optimization.compile.mode={compile_cfg.mode!r} needs the inductor backend; "
            "use mode: default with other backends."
        )
    if compile_cfg.options and (compile_cfg.mode != "default" or not inductor):
        raise ValueError(
            "optimization.compile.options are inductor options, which torch.compile takes "
            f"only with mode: default and the inductor backend (mode is {compile_cfg.mode!r});"
            " set mode: default, or leave options empty."
        )
    kwargs: dict[str, Any] = {"dynamic": compile_cfg.dynamic}
    if backend is not None:
        kwargs["backend"] = backend
    if inductor:
        from torch._inductor import list_mode_options

        options = (
            list_mode_options(compile_cfg.mode, compile_cfg.dynamic)
            | correct_gradient_options()
            | inductor_options(compile_cfg.options)
        )
        if options:
            kwargs["options"] = options
    return kwargs


def compile_wanted(compile_cfg: Any, device: torch.device, memory_cfg: Any = None) -> bool:
    """Whether ``prepare`` compiles under ``compile_cfg.enabled``: ``True``, or ``"auto"`` on
    CUDA without block swap (``memory_cfg.block_swap``); ``"auto"`` leaves CPU runs eager, where
    inductor's C++ compile of a small model costs more than it gains.

    Example:
        >>> from types import SimpleNamespace
        >>> compile_wanted(SimpleNamespace(enabled="auto"), torch.device("cpu"))
        False
        >>> compile_wanted(SimpleNamespace(enabled="auto"), torch.device("cuda", 0))
        True
    """
    if compile_cfg.enabled == "auto":
        swapping = getattr(memory_cfg, "block_swap", None) is not None
        return device.type == "cuda" and not swapping
    return bool(compile_cfg.enabled)


def compile_blocks(
    model: nn.Module,
    compile_cfg: Any,
    *,
    paths: Sequence[str] | None = None,
    backend: str | Callable | None = None,
    memory_budget: float | None = None,
    block_contexts: Sequence[Callable[[], AbstractContextManager]] = (),
) -> list[str]:
    """Compile the repeated blocks of ``model`` in place (module docstring); returns their paths.

    ``compile_cfg`` is an ``optimization.compile`` section (``mode``, ``dynamic``, ``options``).
    ``paths`` overrides the blocks (default: :func:`litegen.model_parts.blocks.repeated_blocks`; the whole
    model's ``forward`` when it has none).
    ``backend`` is for tests (``"aot_eager"`` skips inductor's C++/Triton code generation); runs
    use inductor. ``memory_budget`` in [0, 1] bounds what each compiled block saves for backward
    (module docstring); ``None`` leaves compile's default. ``block_contexts`` are entered around
    every call of a compiled block (module docstring).

    Example:
        >>> from litegen.config.sections import CompileConfig
        >>> dit = nn.Module()
        >>> dit.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        >>> compile_blocks(dit, CompileConfig(enabled=True, mode="max-autotune-no-cudagraphs"))
        ['blocks.0', 'blocks.1']
    """
    if paths is None:
        paths = repeated_blocks(model)
        if not paths:
            log.info(
                "%s has no repeated blocks; compiling its whole forward instead",
                type(model).__name__,
            )
            paths = [""]
    kwargs = compile_kwargs(compile_cfg, backend)
    if compile_cfg.dynamic is None:
        # Automatic dynamic shapes are what bounds recompiles; an older torch or a user may
        # have turned them off globally.
        torch._dynamo.config.automatic_dynamic_shapes = True

    def compiled_forward(original: Callable, patched: bool, is_block: bool) -> _CompiledForward:
        try:
            compiled = torch.compile(original, **kwargs)
        except RuntimeError as exc:  # torch checks the options' names and types here
            if not compile_cfg.options:
                raise
            reason = str(exc).split(", known options")[0]  # the rest lists every option
            raise ValueError(
                f"optimization.compile.options: {reason}; the names and types are those of "
                "torch._inductor.config."
            ) from exc
        return _CompiledForward(
            original,
            compiled,
            patched,
            memory_budget,
            is_block=is_block,
            block_contexts=block_contexts,
        )

    done: list[str] = []
    for path in paths:
        module = model.get_submodule(path) if path else model
        if is_compiled(module):
            continue
        managed = block_forward(module)
        if managed is not None:  # checkpointing/offload: compile what each mode runs
            managed.compile(functools.partial(compiled_forward, patched=False, is_block=bool(path)))
        else:
            module.forward = compiled_forward(
                module.forward, "forward" in module.__dict__, is_block=bool(path)
            )
        done.append(path)
    return done


__all__ = [
    "compile_blocks",
    "compile_kwargs",
    "compile_wanted",
    "correct_gradient_options",
    "inductor_options",
    "is_compiled",
]
