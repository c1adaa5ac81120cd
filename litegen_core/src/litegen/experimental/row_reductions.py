"""One-pass (persistent) norms in compiled blocks: ``optimization.experimental.persistent_rows``.

Inductor compiles a reduction along rows of at most 1024 elements as a *persistent* Triton
kernel: a program holds its rows in registers, so a LayerNorm reads its input once. Longer rows
get a *looped* kernel that reads them twice, once for the mean and variance and once to
normalise. DiT-XL's hidden size, 1152, and Wan 1.3B's, 1536, sit past the limit.

Forward rows made persistent here also get a fixed launch config, one row a program and a warp
for every 1024 elements (:func:`row_launch_config`), instead of inductor's autotuning, whose
coordinate-descent search stopped at different configs from one machine start to the next; the
fixed config measured fastest of a grid (``scripts/lab/sweep_row_kernels.py``, benchmarks/). Torch
2.11 cannot generate every kernel with one row a program, so there the config has two
(:data:`ROWS_PER_PROGRAM`).

Backward rows: the input gradient of a LayerNorm is a row reduction too. Those rows are made
persistent kernel by kernel, where inductor's tiling scores call the kernel a row reduction;
sums of gradients down the tokens (the adaLN scale and shift) keep their loop, which measured
faster. Their launch config stays autotuned, because a fixed one with one row a program is what
torch 2.11 fails to generate for them.

:class:`PersistentRows` is inductor's own heuristics (``InductorChoices``) with that one
threshold raised and those launch configs. :func:`persistent_rows_context` installs it only
around calls of LiteGen's compiled blocks, where their forward and backward graphs compile, so
other compiled code in the process is unchanged.

Example::

    from torch._inductor.virtualized import V
    with V.set_choices_handler(PersistentRows(2048)):
        y = compiled_block(x, c)  # its first call compiles forward and backward
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any

import sympy
import torch
from torch._inductor import config
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

try:  # fixed launch configs of generated kernels (torch >= 2.6)
    from torch._inductor.codegen.triton import FixedTritonConfig
except ImportError:  # pragma: no cover - older torch autotunes as before
    FixedTritonConfig = None

__all__ = ["ROWS_PER_PROGRAM", "PersistentRows", "persistent_rows_context", "row_launch_config"]

# Inductor's own limit for persistent row reductions (``InductorChoices``).
_INDUCTOR_PERSISTENT_ROWS = 1024

# Reductions down columns: one element per row, so a persistent program would hold a column
# strip of many rows; inductor's small limit for them stays.
_COLUMN_HINTS = (ReductionHint.OUTER, ReductionHint.OUTER_TINY)
# A change to this file's heuristics must not be served kernels cached under the old ones.
_SOURCE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


class PersistentRows(InductorChoices):
    """Inductor's choices, with row reductions of up to ``limit`` elements persistent.

    The forward rows it makes persistent (longer than inductor's own 1024) also get a fixed
    launch config, :func:`row_launch_config`, instead of inductor's autotuning; backward rows
    keep it (module docstring).

    Example:
        >>> PersistentRows(2048).limit
        2048
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def cache_key(self) -> str:
        """Names these heuristics (this module's code and the limit) in compile-cache keys.

        Example:
            >>> PersistentRows(2048).cache_key().endswith("-2048")
            True
        """
        return f"litegen.PersistentRows-{_SOURCE_HASH}-{self.limit}"

    def _rows_in_range(self, features: Any, low: int) -> bool:
        numel = features.reduction_numel
        return (
            config.triton.persistent_reductions
            and features.get_reduction_hint() not in _COLUMN_HINTS
            and isinstance(numel, (int, sympy.Integer))
            and low < int(numel) <= self.limit
        )

    def should_use_persistent_reduction(  # type: ignore[override]
        self, features: Any, cooperative_reduction: bool
    ) -> bool:
        # Backward graphs: only the rows that ``triton_kernel_kwargs`` picks (module docstring).
        forward = not V.graph.is_backward
        if forward and not cooperative_reduction and self._rows_in_range(features, 0):
            return True
        return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    def triton_kernel_kwargs(  # type: ignore[override]
        self, kernel_cls: Any, features: Any, groups: Any, kernel_kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        kwargs = super().triton_kernel_kwargs(kernel_cls, features, groups, kernel_kwargs)
        if (
            FixedTritonConfig is None
            or config.triton.multi_kernel  # its looped variant would get the fixed config too
            or not features.is_reduction()
            or not self._rows_in_range(features, _INDUCTOR_PERSISTENT_ROWS)
            or _kernel_hint(features, kwargs.get("tiling_scores")) != ReductionHint.INNER
        ):
            return kwargs
        one_pass = {"override_cooperative_reduction": False, "override_persistent_reduction": True}
        if V.graph.is_backward:  # one pass, launch config autotuned (module docstring)
            return {**kwargs, **one_pass}
        launch = row_launch_config(int(features.reduction_numel), ROWS_PER_PROGRAM)
        return {**kwargs, **one_pass, "fixed_config": FixedTritonConfig(launch)}


def _kernel_hint(features: Any, tiling_scores: dict[str, int] | None) -> ReductionHint:
    """The hint the kernel will carry: inductor upgrades some rows to INNER by their tiling."""
    try:
        return features.get_reduction_hint(tiling_scores)
    except TypeError:  # torch before tiling scores: the hint of the nodes alone
        return features.get_reduction_hint()


def _one_row_programs_compile() -> bool:
    """Whether this torch's inductor can generate one-row-a-program kernels that load per row.

    With one row a program, inductor drops the kernel's row dimension. Torch 2.11's shape
    propagation still indexes it, and fails ("list indices must be integers or slices, not
    NoneType") on a kernel that loads a value per row: a LayerNorm of ``x * gate`` with one
    gate per token, or C's LayerNorm backward, which loads the saved mean. Later torch treats
    the dropped dimension as a scalar, which is what this looks for.
    """
    try:
        from torch._inductor.codegen.triton import TritonSymbols

        return "tensor_dim is None" in inspect.getsource(TritonSymbols.get_block_shape)
    except (ImportError, AttributeError, OSError, TypeError):
        return False


# One row a program measured fastest; two where inductor cannot generate it (docstring above).
ROWS_PER_PROGRAM = 1 if _one_row_programs_compile() else 2


def row_launch_config(row_numel: int, rows: int = 1) -> dict[str, int]:
    """The launch config of a persistent kernel over ``rows`` rows of ``row_numel`` elements.

    A warp for every 1024 elements of the row padded to a power of two, so that with one row a
    program each thread holds 32 of them.

    Example:
        >>> row_launch_config(1152)
        {'XBLOCK': 1, 'num_warps': 2}
        >>> row_launch_config(1152, rows=2)
        {'XBLOCK': 2, 'num_warps': 2}
    """
    padded = 1 << (row_numel - 1).bit_length()
    return {"XBLOCK": rows, "num_warps": max(1, min(32, padded // 1024))}


class _CacheKey(CustomGraphPass):
    """A post-grad pass that leaves the graph as it is; its ``uuid`` joins the cache keys."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self.key


def _caches_keyed_on(choices: PersistentRows, slot_free: bool) -> ExitStack:
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


def _backward_compiled_in_this_call() -> AbstractContextManager:
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


def persistent_rows_context(
    limit: int, compile_options: dict[str, Any] | None = None
) -> Callable[[], AbstractContextManager]:
    """The context :func:`litegen.compile.compile_blocks` enters around each compiled block call.

    It installs :class:`PersistentRows` (``limit``) as inductor's heuristics, keys the compile
    caches on it, and has the block's backward graph compile inside the call, where the
    heuristics are set. ``compile_options`` are ``optimization.compile.options``: a user's own
    post-grad pass there turns the caches off instead.

    Example::

        compile_blocks(dit, compile_cfg, block_contexts=[persistent_rows_context(2048)])
    """
    from torch._inductor.virtualized import V

    choices = PersistentRows(limit)
    slot_free = "post_grad_custom_post_pass" not in (compile_options or {})

    def context() -> AbstractContextManager:
        settings = ExitStack()
        settings.enter_context(V.set_choices_handler(choices))
        settings.enter_context(_caches_keyed_on(choices, slot_free))
        settings.enter_context(_backward_compiled_in_this_call())
        return settings

    return context
