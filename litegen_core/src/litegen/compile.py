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
``_orig_mod.`` prefix). A checkpointed block's ``forward`` is already the checkpoint wrapper,
so the compiled region contains the checkpoint and its recomputation.

``dynamic``: ``None`` lets Dynamo compile the first shape static and, at the first new shape,
recompile once with dynamic sizes (at most two compiles per block for any number of
resolutions); ``True`` compiles dynamic from the start; ``False`` specialises on every shape, so
variable resolutions recompile until ``torch._dynamo.config.recompile_limit`` (8) and then run
eagerly: use it only for fixed shapes.

``persistent_rows``: inductor reduces rows of up to 1024 elements in one pass, longer ones in
two; LiteGen can raise that limit for the blocks' graphs (:mod:`litegen.kernels.row_reductions`),
again only around each call of a compiled block, with the heuristics added to the compile
caches' keys (:func:`_caches_keyed_on`). The block's backward graph then compiles inside that
call too, with its forward (:func:`_backward_compiled_in_this_call`).

``pack_qkv`` (runs whose attention is FA4): inductor's pre-grad pass slot gets
:class:`litegen.kernels.packed_qkv.PackQkvAttention`, again only around each call of a compiled
block, so that FA4's backward writes the gradient of a block's packed qkv tensor in one buffer.

``sequence_parallel`` (``optimization.parallel.sp_size > 1``): the sequence-parallel attention
enters a torch-function mode inside each block (:mod:`litegen.parallel.sequence.attention`).
Inside an activation checkpoint Dynamo counts that as a side effect to replay in the
recomputation and breaks the graph; the mode's effect is already in the traced graph, which the
compiled backward recomputes, so Dynamo is told not to replay it
(``skip_fwd_side_effects_in_bwd_under_checkpoint``), again only around each call.

``memory_budget`` (activation checkpointing's ``memory_budget`` policy): AOTAutograd's min-cut
partitioner decides, when it splits a compiled block into forward and backward, which
activations to save and which to recompute. Below 1 it solves a knapsack over the block's ops:
keep the saved bytes within the budget while recomputing what its runtime estimate (FLOP
counts) calls cheapest. 0 saves the least it can, 1 what it saves by default. The budget is
set around each call of a compiled block, where that split happens, rather than process-wide,
so code outside LiteGen's blocks compiles as usual.

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
    >>> compile_blocks(dit, CompileConfig(enabled=True, dynamic=None))
    ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.nn.parallel import DistributedDataParallel

from litegen.memory.blocks import repeated_blocks

log = logging.getLogger("litegen")

# Dynamo's switch for side effects in checkpointed code (module docstring, sequence_parallel).
_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


class _CompiledForward:
    """Marks a compiled ``forward`` so a second ``prepare`` never compiles a block twice."""

    def __init__(
        self,
        original: Callable,
        compiled: Callable,
        patched: bool,
        memory_budget: float | None = None,
        is_block: bool = True,
        choices: Any = None,
        cache_key_slot_free: bool = True,
        pre_grad_pass: CustomGraphPass | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        self.original = original  # what ``forward`` was: the class's or an instance patch
        self.compiled = compiled
        self.patched = patched  # whether ``original`` was set on the instance (checkpointing)
        self.memory_budget = memory_budget
        # A block's backward is its own autograd node; a whole model's is not (module docstring).
        self.is_block = is_block
        self.choices = choices  # inductor heuristics for this block's graphs, or None
        # Whether torch.compile's options leave inductor's post-grad pass slot to LiteGen.
        self.cache_key_slot_free = cache_key_slot_free
        self.pre_grad_pass = pre_grad_pass  # LiteGen's rewrite of the blocks' graphs, or None
        self.sequence_parallel = sequence_parallel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # These settings are read while Dynamo, AOTAutograd and inductor compile the block, which
        # happens inside this call on its first run and on every recompile (module docstring).
        # Each is set only where it applies, so that elsewhere the call stays plain for an outer
        # ``torch.compile``.
        with ExitStack() as settings:
            if self.is_block and DistributedDataParallel._get_active_ddp_module() is not None:
                settings.enter_context(torch._dynamo.config.patch(optimize_ddp=False))
            if self.sequence_parallel and hasattr(torch._dynamo.config, _SKIP_REPLAY):
                settings.enter_context(torch._dynamo.config.patch(**{_SKIP_REPLAY: True}))
            if self.memory_budget is not None:
                budget = {"activation_memory_budget": self.memory_budget}
                settings.enter_context(torch._functorch.config.patch(**budget))
            if self.choices is not None:
                from torch._inductor.virtualized import V

                settings.enter_context(V.set_choices_handler(self.choices))
                settings.enter_context(_caches_keyed_on(self.choices, self.cache_key_slot_free))
                settings.enter_context(_backward_compiled_in_this_call())
            inductor_config = torch._inductor.config
            if self.pre_grad_pass is not None and inductor_config.pre_grad_custom_pass is None:
                pre_grad = {"pre_grad_custom_pass": self.pre_grad_pass}
                settings.enter_context(inductor_config.patch(**pre_grad))
            return self.compiled(*args, **kwargs)


class _CacheKey(CustomGraphPass):
    """A post-grad pass that leaves the graph as it is; its ``uuid`` joins the cache keys."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self.key


def _caches_keyed_on(choices: Any, slot_free: bool) -> ExitStack:
    """Compile caches that tell graphs compiled with ``choices`` from all others.

    Inductor's and AOTAutograd's caches key on inductor's config and its custom passes, not on
    its heuristics, so on their own they would hand graphs compiled with ``choices`` to compiles
    without them, and the other way round. A custom post-grad pass that changes nothing puts
    ``choices`` into the keys. Where that slot holds a pass of the user's (inductor's config,
    or ``optimization.compile.options``, which inductor applies over ours), the caches are off.
    """
    settings = ExitStack()
    inductor_config = torch._inductor.config
    if slot_free and inductor_config.post_grad_custom_post_pass is None:
        key = _CacheKey(choices.cache_key())
        settings.enter_context(inductor_config.patch(post_grad_custom_post_pass=key))
    else:
        settings.enter_context(inductor_config.patch(fx_graph_cache=False))
        autograd_cache = {"enable_autograd_cache": False}
        settings.enter_context(torch._functorch.config.patch(**autograd_cache))
    return settings


def _backward_compiled_in_this_call() -> Any:
    """Has AOTAutograd compile a block's backward graph with its forward, inside the call.

    With static shapes it compiles the backward lazily, at the first backward, after the block's
    call has returned and its heuristics are unset, so they would reach forward graphs only.
    Compiling it at once costs nothing more: every block that trains runs its backward. Torch
    without the switch keeps compiling lazily.
    """
    functorch_config = torch._functorch.config
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled this module's ``forward``."""
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


def compile_blocks(
    model: nn.Module,
    compile_cfg: Any,
    *,
    paths: Sequence[str] | None = None,
    backend: str | Callable | None = None,
    memory_budget: float | None = None,
    pack_qkv: bool = False,
    sequence_parallel: bool = False,
) -> list[str]:
    """Compile the repeated blocks of ``model`` in place (module docstring); returns their paths.

    ``compile_cfg`` is an ``optimization.compile`` section (``mode``, ``dynamic``, ``options``,
    ``persistent_rows``). ``paths`` overrides the blocks (default:
    :func:`litegen.memory.repeated_blocks`; the whole model's ``forward`` when it has none).
    ``backend`` is for tests (``"aot_eager"`` skips inductor's C++/Triton code generation); runs
    use inductor. ``memory_budget`` in [0, 1] bounds what each compiled block saves for backward
    (module docstring); ``None`` leaves compile's default. ``pack_qkv`` (for runs whose attention
    is FA4) hands FA4 the packed qkv tensor of each block's attention
    (:mod:`litegen.kernels.packed_qkv`), unless inductor's options hold a pre-grad pass already.
    ``sequence_parallel``: the blocks hold sequence-parallel attention (module docstring).

    Example:
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
    kwargs: dict[str, Any] = {"dynamic": compile_cfg.dynamic}
    if backend is not None:
        kwargs["backend"] = backend
    if compile_cfg.mode != "default":
        if backend not in (None, "inductor"):
            raise ValueError(
                f"optimization.compile.mode={compile_cfg.mode!r} needs the inductor backend; "
                "use mode: default with other backends."
            )
        kwargs["mode"] = compile_cfg.mode
    if compile_cfg.options:
        if compile_cfg.mode != "default" or backend not in (None, "inductor"):
            raise ValueError(
                "optimization.compile.options are inductor options, which torch.compile takes "
                f"only with mode: default and the inductor backend (mode is {compile_cfg.mode!r});"
                " set mode: default, or leave options empty."
            )
        kwargs["options"] = inductor_options(compile_cfg.options)
    choices = None
    if compile_cfg.persistent_rows is not None:  # read by inductor only; other backends skip it
        from litegen.kernels.row_reductions import PersistentRows

        choices = PersistentRows(compile_cfg.persistent_rows)
    pre_grad_pass = None
    if pack_qkv and "pre_grad_custom_pass" not in kwargs.get("options", {}):
        from litegen.kernels.packed_qkv import PACK_QKV

        pre_grad_pass = PACK_QKV
    if compile_cfg.dynamic is None:
        # Automatic dynamic shapes are what bounds recompiles; an older torch or a user may
        # have turned them off globally.
        torch._dynamo.config.automatic_dynamic_shapes = True
    done: list[str] = []
    for path in paths:
        module = model.get_submodule(path) if path else model
        if is_compiled(module):
            continue
        original = module.forward
        patched = "forward" in module.__dict__
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
        module.forward = _CompiledForward(
            original,
            compiled,
            patched,
            memory_budget,
            is_block=bool(path),
            choices=choices,
            cache_key_slot_free="post_grad_custom_post_pass" not in kwargs.get("options", {}),
            pre_grad_pass=pre_grad_pass,
            sequence_parallel=sequence_parallel,
        )
        done.append(path)
    return done


def uncompile_blocks(model: nn.Module) -> int:
    """Restore the eager ``forward`` of every compiled module; returns how many were restored."""
    count = 0
    for module in model.modules():
        if is_compiled(module):
            wrapper = module.__dict__.pop("forward")
            if wrapper.patched:
                module.forward = wrapper.original
            count += 1
    return count


__all__ = ["compile_blocks", "is_compiled", "uncompile_blocks"]
