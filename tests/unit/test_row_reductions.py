"""``optimization.experimental.persistent_rows``: which reductions inductor is told to run in one pass.

The heuristic is checked against inductor's own on the same inputs; that the generated kernels
change (and compute the same) is checked on CUDA in ``tests/gpu/test_perf_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sympy
import torch
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.sizevars import SizeVarAllocator
from torch._inductor.virtualized import V

from litegen.compile import compile_blocks
from litegen.experimental.row_reductions import (
    ROWS_PER_PROGRAM,
    PersistentRows,
    persistent_rows_context,
    row_launch_config,
)
from litegen.utils.config import CompileConfig, MainConfig


class Features:
    """What the heuristics read from inductor's ``SIMDKernelFeatures``: rows of ``numel``.

    ``tiled_hint`` is the hint once inductor has the kernel's tiling scores, which can upgrade
    DEFAULT to INNER (rows that are contiguous in memory).
    """

    def __init__(self, numel: int, hint: ReductionHint, tiled_hint: ReductionHint | None = None):
        self.reduction_numel = sympy.Integer(numel)  # a static size, as inductor has it
        self.numel = sympy.Integer(32768)  # rows
        self.hint = hint
        self.tiled_hint = tiled_hint or hint

    def is_reduction(self) -> bool:
        return True

    def get_reduction_hint(self, tiling_scores=None) -> ReductionHint:
        return self.hint if tiling_scores is None else self.tiled_hint


def decide(features: Features, *, backward: bool = False, cooperative: bool = False):
    """(LiteGen's choice, inductor's choice) inside a stand-in for a graph being lowered."""
    graph = SimpleNamespace(is_backward=backward, sizevars=SizeVarAllocator())
    with V.set_graph_handler(graph):
        ours = PersistentRows(2048).should_use_persistent_reduction(features, cooperative)
        theirs = InductorChoices.should_use_persistent_reduction(features, cooperative)
    return ours, theirs


def test_forward_rows_up_to_the_limit_become_persistent():
    for hint in (ReductionHint.INNER, ReductionHint.DEFAULT):
        assert decide(Features(1152, hint)) == (True, False)
        assert decide(Features(2048, hint)) == (True, False)
    assert decide(Features(512, ReductionHint.INNER)) == (True, True)  # inductor's limit: 1024


@pytest.mark.parametrize(
    "features, kwargs",
    [
        (Features(1152, ReductionHint.INNER), {"backward": True}),
        (Features(1152, ReductionHint.OUTER), {}),
        (Features(1152, ReductionHint.OUTER_TINY), {}),
        (Features(2049, ReductionHint.INNER), {}),
        (Features(1152, ReductionHint.INNER), {"cooperative": True}),
    ],
    ids=["backward-rows", "columns", "tiny-columns", "past-limit", "cooperative"],
)
def test_everything_else_keeps_inductors_choice(features, kwargs):
    # Backward rows are made one-pass per kernel, by ``triton_kernel_kwargs`` (below).
    ours, theirs = decide(features, **kwargs)
    assert ours == theirs


def test_persistent_reductions_off_stays_off():
    with inductor_config.patch({"triton.persistent_reductions": False}):
        assert decide(Features(1152, ReductionHint.INNER)) == (False, False)


def launch_kwargs(features: Features, *, backward: bool = False, **kernel_kwargs):
    """The kwargs LiteGen's choices hand inductor's ``TritonKernel`` for ``features``."""
    graph = SimpleNamespace(is_backward=backward, sizevars=SizeVarAllocator())
    with V.set_graph_handler(graph):
        return PersistentRows(2048).triton_kernel_kwargs(None, features, [], kernel_kwargs)


def test_rows_made_persistent_get_a_fixed_launch_config():
    scores = {"x": 524288, "r0_": 227082240}  # C's forward norm kernel
    for features in (
        Features(1152, ReductionHint.INNER),
        Features(1152, ReductionHint.DEFAULT, tiled_hint=ReductionHint.INNER),
    ):
        kwargs = launch_kwargs(features, tiling_scores=scores)
        assert kwargs["fixed_config"].config == {"XBLOCK": ROWS_PER_PROGRAM, "num_warps": 2}
        assert kwargs["override_persistent_reduction"] is True
        assert kwargs["tiling_scores"] == scores  # inductor's own kwargs pass through
    assert row_launch_config(2048) == {"XBLOCK": 1, "num_warps": 2}
    assert row_launch_config(4096) == {"XBLOCK": 1, "num_warps": 4}
    assert row_launch_config(1152, rows=2) == {"XBLOCK": 2, "num_warps": 2}


def test_one_row_a_program_only_where_inductor_can_generate_it(monkeypatch):
    from torch._inductor.codegen.triton import TritonSymbols

    from litegen.experimental import row_reductions

    # The locked torch (2.13) generates them; torch 2.11 fails on them (tests/gpu).
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13):
        assert ROWS_PER_PROGRAM == 1

    def get_block_shape(cls, expr):  # as torch 2.11 has it: indexes the dropped dimension
        return [expr][cls.tree.tensor_dim]

    monkeypatch.setattr(TritonSymbols, "get_block_shape", classmethod(get_block_shape))
    assert not row_reductions._one_row_programs_compile()


def test_backward_rows_become_one_pass_and_keep_inductors_tuning():
    scores = {"x": 262144, "r0_": 906559488}  # C's backward norm kernel
    for features in (
        Features(1152, ReductionHint.INNER),
        Features(1152, ReductionHint.DEFAULT, tiled_hint=ReductionHint.INNER),
    ):
        kwargs = launch_kwargs(features, backward=True, tiling_scores=scores)
        assert kwargs["override_persistent_reduction"] is True
        assert kwargs["override_cooperative_reduction"] is False
        assert "fixed_config" not in kwargs
    # Rows that stay DEFAULT with their tiling (sums down the tokens, in C) keep their loop.
    kwargs = launch_kwargs(Features(1152, ReductionHint.DEFAULT), backward=True, tiling_scores={})
    assert "override_persistent_reduction" not in kwargs


@pytest.mark.parametrize(
    "features, kwargs",
    [
        (Features(512, ReductionHint.INNER), {}),  # persistent in inductor already
        (Features(512, ReductionHint.INNER), {"backward": True}),
        (Features(1152, ReductionHint.DEFAULT), {}),  # not contiguous rows
        (Features(1152, ReductionHint.OUTER), {}),
        (Features(1152, ReductionHint.OUTER), {"backward": True}),
        (Features(2049, ReductionHint.INNER), {}),
        (Features(2049, ReductionHint.INNER), {"backward": True}),
    ],
    ids=[
        "short-rows",
        "short-backward-rows",
        "default-hint",
        "columns",
        "backward-columns",
        "past-limit",
        "backward-past-limit",
    ],
)
def test_other_kernels_keep_inductors_tuning(features, kwargs):
    found = launch_kwargs(features, tiling_scores={"x": 1, "r0_": 1}, **kwargs)
    assert "fixed_config" not in found and "override_persistent_reduction" not in found


def test_multi_kernel_keeps_inductors_tuning():
    with inductor_config.patch({"triton.multi_kernel": 1}):
        assert "fixed_config" not in launch_kwargs(Features(1152, ReductionHint.INNER))


def compile_with_rows(model: nn.Module, limit: int | None, backend=None) -> None:
    """Compile the blocks as prepare does with ``experimental.persistent_rows: limit``."""
    context = [persistent_rows_context(limit)] if limit is not None else []
    compile_blocks(model, CompileConfig(enabled=True), backend=backend, block_contexts=context)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("limit", [None, 2048])
def test_handler_is_set_only_while_a_block_compiles(limit):
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):  # runs inside the block's first call
        seen.append(V.choices)
        return gm.forward

    model = Blocks()
    compile_with_rows(model, limit, backend=backend)
    model(torch.randn(2, 8))
    assert len(seen) == 2  # one graph per block here (two ``Sequential`` instances)
    if limit is None:
        assert not any(isinstance(choices, PersistentRows) for choices in seen)
    else:
        assert all(isinstance(choices, PersistentRows) for choices in seen)
        assert seen[0].limit == limit
    assert not isinstance(V.choices, PersistentRows)  # restored after the call
    torch._dynamo.reset()


@pytest.mark.skipif(
    not hasattr(functorch_config, "force_non_lazy_backward_lowering"),
    reason="this torch compiles backward graphs lazily, outside the block's call",
)
def test_backward_graphs_compile_inside_the_blocks_call_with_the_handler_set():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    seen = []

    def compiler(name):
        def compile_graph(gm, example_inputs):
            seen.append((name, isinstance(V.choices, PersistentRows)))
            return make_boxed_func(gm.forward)

        return compile_graph

    backend = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))
    model = Blocks()
    compile_with_rows(model, 2048, backend=backend)
    out = model(torch.randn(2, 8, requires_grad=True))
    # The backward graph compiled before any backward ran, with LiteGen's heuristics.
    assert seen[:2] == [("forward", True), ("backward", True)], seen
    compiled = len(seen)
    out.sum().backward()
    assert len(seen) == compiled
    torch._dynamo.reset()


def test_config_rejects_a_non_positive_limit_and_a_limit_without_compile():
    on = {"compile": {"enabled": True}}
    with pytest.raises(ValueError, match="persistent_rows"):
        MainConfig.model_validate({"optimization": {**on, "experimental": {"persistent_rows": 0}}})
    with pytest.raises(ValueError, match="compile is off"):
        MainConfig.model_validate({"optimization": {"experimental": {"persistent_rows": 2048}}})
    optimization = {**on, "experimental": {"persistent_rows": 2048}}
    config = MainConfig.model_validate({"optimization": optimization})
    assert config.optimization.experimental.persistent_rows == 2048


def compile_and_run(limit: int | None) -> dict[str, int]:
    """Compile fresh blocks (forward and backward) and return the compile caches' counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Blocks()
    compile_with_rows(model, limit)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    found = {**counters["inductor"], **counters["aot_autograd"]}
    torch._dynamo.reset()
    return {k: v for k, v in found.items() if k.startswith(("fxgraph_cache", "autograd_cache"))}


class UserPass(CustomGraphPass):
    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> str:
        return "a user's pass"


@pytest.fixture
def empty_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    caches_on = functorch_config.patch(enable_autograd_cache=True)
    with inductor_config.patch(fx_graph_cache=True), caches_on:
        yield


def test_compile_caches_serve_each_setting_only_its_own_graphs(empty_compile_cache):
    # Each run compiles one forward and one backward graph, both inside the block's call.
    first = compile_and_run(2048)
    assert first.get("autograd_cache_miss") == 1 and first.get("fxgraph_cache_miss") == 2
    assert compile_and_run(2048).get("autograd_cache_hit") == 1
    for other in (None, 4096):  # the same block compiled without the setting, or another limit
        counts = compile_and_run(other)
        assert counts.get("autograd_cache_miss") == 1, counts
        assert counts.get("fxgraph_cache_miss") == 2, counts  # both graphs, compiled anew
    assert compile_and_run(None).get("autograd_cache_hit") == 1


def test_compile_caches_are_off_when_the_key_slot_holds_a_users_pass(empty_compile_cache):
    with inductor_config.patch(post_grad_custom_post_pass=UserPass()):
        compile_and_run(2048)
        again = compile_and_run(2048)
    assert not again.get("autograd_cache_hit")
    assert again.get("fxgraph_cache_hit", 0) <= 1, again  # the backward graph at most
