"""Fused GELU MLPs on CPU: which MLPs match, and the op's autograd, compile and FLOP plumbing.

Off CUDA the op runs torch's kernels, so equality with the unfused module checks everything but
cuBLASLt's epilogues, which ``tests/gpu/test_gelu_mlp_gpu.py`` compares on the GPU.
"""

from __future__ import annotations

import copy
import io
import sys
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.flop_counter import FlopCounterMode

import litegen
from litegen.compile import compile_blocks
from litegen.experimental import TESTED_TORCH, torch_release
from litegen.experimental.fused_gelu_mlp import apply_fused_gelu_mlp, is_fused
from litegen.experimental.fused_gelu_mlp_op import sum_rows
from litegen.utils.config import CompileConfig, MainConfig
from litegen_zoo.dit_model import DiT, DiTConfig, sample_batch

TINY = DiTConfig(hidden=32, depth=3, heads=2, num_classes=10)


def sequential_mlp(act: nn.Module | None = None, bias: bool = True) -> nn.Sequential:
    act = nn.GELU(approximate="tanh") if act is None else act
    return nn.Sequential(nn.Linear(16, 64, bias=bias), act, nn.Linear(64, 16, bias=bias))


class Mlp(nn.Module):
    """timm's ``Mlp`` (what the reference DiT uses), dropout configurable; timm is not installed
    here, so the stand-in takes timm's module name, which the matcher checks."""

    def __init__(self, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Linear(16, 64),
            nn.GELU(approximate="tanh"),
            nn.Linear(64, 16),
        )
        self.drop1, self.norm, self.drop2 = nn.Dropout(drop), nn.Identity(), nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


Mlp.__module__ = Mlp.forward.__module__ = "timm.layers.mlp"


class OtherMlp(Mlp):
    """Named like timm's, but with a forward of its own (a residual MLP)."""

    def forward(self, x):
        return x + super().forward(x)


OtherMlp.__name__ = "Mlp"


def grads_of(model: nn.Module, x: torch.Tensor, *args) -> tuple[torch.Tensor, dict]:
    x = x.clone().requires_grad_()
    loss = model(x, *args).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return x.grad, grads | {"loss": loss.detach()}


def assert_same_gradients(got: tuple, expected: tuple, **tolerance) -> None:
    """``(dx, grads)`` of :func:`grads_of` against the reference's: the input gradient at the
    default tolerance, each parameter's (and the loss) at ``tolerance``, named on a mismatch."""
    (dx, grads), (ref_dx, ref_grads) = got, expected
    torch.testing.assert_close(dx, ref_dx)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name, **tolerance)


@pytest.mark.parametrize("make", [sequential_mlp, Mlp], ids=["sequential", "timm_mlp"])
def test_fused_mlp_matches_the_module_with_the_same_parameter_names(make):
    torch.manual_seed(0)
    reference = make()
    fused = copy.deepcopy(reference)
    keys = list(fused.state_dict())
    assert apply_fused_gelu_mlp(fused) == 1
    assert apply_fused_gelu_mlp(fused) == 1  # idempotent: the same module, routed once
    assert list(fused.state_dict()) == keys
    x = torch.randn(2, 5, 16)
    ref_dx, ref_grads = grads_of(reference, x)
    dx, grads = grads_of(fused, x)
    assert_same_gradients((dx, grads), (ref_dx, ref_grads))


def with_hook(model: nn.Sequential) -> nn.Sequential:
    model[0].register_forward_hook(lambda module, args, out: out * 2)
    return model


@pytest.mark.parametrize(
    "model",
    [
        sequential_mlp(nn.GELU()),  # exact GELU: cuBLASLt's epilogue is the tanh form
        sequential_mlp(bias=False),
        nn.Sequential(*sequential_mlp(), nn.Identity()),
        Mlp(drop=0.1),
        OtherMlp(),
        with_hook(sequential_mlp()),
        nn.Sequential(
            nn.utils.parametrizations.weight_norm(nn.Linear(16, 64)), *sequential_mlp()[1:]
        ),
    ],
    ids=["exact_gelu", "no_bias", "four_layers", "dropout", "not_timm", "hook", "weight_norm"],
)
def test_mlps_that_compute_something_else_are_left_alone(model):
    assert apply_fused_gelu_mlp(model) == 0
    assert not any(is_fused(m) for m in model.modules())


def test_a_fused_mlp_changed_later_runs_its_own_forward_again():
    torch.manual_seed(0)
    reference = sequential_mlp()
    fused = copy.deepcopy(reference)
    apply_fused_gelu_mlp(fused)
    for model in (reference, fused):  # e.g. an FSDP unit or a hook arriving after prepare
        model[0].register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(3, 16)
    torch.testing.assert_close(fused(x), reference(x))
    torch.testing.assert_close(fused[:2](x), reference[:2](x))  # slicing keeps working


def saved_shapes(model: nn.Module, x: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes of the tensors autograd saves for ``model(x)``'s backward."""
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x)
    return shapes


def test_a_frozen_fused_mlp_gives_the_input_gradient_alone_and_saves_less():
    # The base MLP of a LoRA run: its weights take no gradient, so the backward computes only
    # the input's, and neither x nor the activation h (tokens x hidden) is kept for it.
    torch.manual_seed(0)
    reference = sequential_mlp().requires_grad_(False)
    fused = copy.deepcopy(reference)
    apply_fused_gelu_mlp(fused)
    x = torch.randn(2, 5, 16)
    for compiled in (False, True):
        model = torch.compile(fused, backend="aot_eager") if compiled else fused
        ref_dx, _ = grads_of(reference, x)
        dx, grads = grads_of(model, x)
        torch.testing.assert_close(dx, ref_dx)
        assert set(grads) == {"loss"} and all(p.grad is None for p in fused.parameters())
    trained = copy.deepcopy(fused).requires_grad_(True)
    x = x.requires_grad_()
    activation = (10, 64)  # (tokens, hidden): pre and h of the trained MLP, pre of the frozen one
    assert saved_shapes(trained, x).count(activation) == 2
    assert saved_shapes(fused, x).count(activation) == 1
    torch._dynamo.reset()


@pytest.fixture
def timm_importable(monkeypatch):
    """``timm.layers.mlp.Mlp`` resolvable by pickle, as it is where timm is installed."""
    for name in ("timm", "timm.layers", "timm.layers.mlp"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules["timm.layers.mlp"], "Mlp", Mlp, raising=False)


@pytest.mark.parametrize("make", [sequential_mlp, Mlp], ids=["sequential", "timm_mlp"])
def test_fused_mlps_survive_pickling_and_deepcopy(make, timm_importable):
    torch.manual_seed(0)
    model = make()
    apply_fused_gelu_mlp(model)
    x = torch.randn(3, 16)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert is_fused(copied) and type(copied) is type(model)
        torch.testing.assert_close(copied(x), model(x))


def test_bias_gradient_sums_are_column_sums():
    matrix = torch.randn(40, 24, dtype=torch.float64)
    torch.testing.assert_close(sum_rows(matrix), matrix.sum(0))


def test_flops_are_counted_as_for_the_unfused_mlp():
    reference = sequential_mlp()
    fused = copy.deepcopy(reference)
    apply_fused_gelu_mlp(fused)
    counts = []
    for model in (reference, fused):
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(4, 16, requires_grad=True)).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def traced_ops(counter: CompileCounterWithBackend) -> list[str]:
    """The ops of every graph Dynamo made, and of the subgraphs (checkpointed regions) in them."""
    return [
        str(node.target)
        for graph in counter.graphs
        for module in graph.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function"
    ]


def assert_compiled_dit_runs_op_like_eager(prepare: Callable[[nn.Module], object], op: str) -> None:
    """A tiny DiT, ``prepare``d and compiled regionally (aot_eager), traces ``op`` into its one
    block graph and gives eager's input and parameter gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = DiT(TINY)
    compiled = copy.deepcopy(eager)
    prepare(compiled)
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(compiled, CompileConfig(enabled=True), backend=counter)
    x, t = sample_batch(TINY, batch=2, tokens=16, device="cpu")
    ref_dx, ref_grads = grads_of(eager, x, t)
    dx, grads = grads_of(compiled, x, t)
    assert counter.frame_count == 1  # the custom op is opaque: no graph break around it
    # Traced, not fallen back to the plain forward (which would match eager just as well).
    assert traced_ops(counter).count(op) == 1
    assert_same_gradients((dx, grads), (ref_dx, ref_grads))
    torch._dynamo.reset()


def test_compiled_dit_blocks_with_fused_mlps_match_eager_in_one_graph():
    assert_compiled_dit_runs_op_like_eager(apply_fused_gelu_mlp, "litegen.gelu_mlp.default")


def test_under_autocast_it_computes_in_the_autocast_dtype_with_fp32_gradients():
    fused = sequential_mlp()
    apply_fused_gelu_mlp(fused)
    with torch.autocast("cpu", torch.bfloat16):
        y = fused(torch.randn(4, 16))
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for p in fused.parameters())


def test_under_autocast_it_matches_the_unfused_mlp_under_autocast():
    # The op casts its parameters as nn.Linear does under autocast, so outputs, input gradients
    # and parameter gradients agree with the unfused module's, not just their dtypes.
    torch.manual_seed(0)
    reference = sequential_mlp()
    fused = copy.deepcopy(reference)
    apply_fused_gelu_mlp(fused)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", torch.bfloat16):
        ref_dx, ref_grads = grads_of(reference, x)
        dx, grads = grads_of(fused, x)
    assert ref_grads["loss"] != 0
    assert_same_gradients((dx, grads), (ref_dx, ref_grads))


def test_prepare_fuses_the_mlps_of_the_model_when_asked(tmp_path, monkeypatch):
    monkeypatch.setitem(TESTED_TORCH, "fused_gelu_mlp", (torch_release(),))
    config = MainConfig.from_dict(
        {
            "results_dir": str(tmp_path),
            "runtime": {"device": "cpu"},
            "global_batch_size": 2,
            "optimization": {"experimental": {"fused_gelu_mlp": True}},
        }
    )
    gen = litegen.initialize(config)
    model = DiT(TINY)
    model = gen.prepare(model)
    fused = [name for name, m in gen.unwrap(model).named_modules() if is_fused(m)]
    assert fused == [f"blocks.{i}.mlp" for i in range(TINY.depth)]


def test_diffusers_gelu_approximate_feed_forward_is_fused_and_computes_the_same():
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    reference = FeedForward(16, activation_fn="gelu-approximate")
    fused = copy.deepcopy(reference)
    assert apply_fused_gelu_mlp(fused) == 1 and is_fused(fused)
    assert apply_fused_gelu_mlp(FeedForward(16, activation_fn="gelu")) == 0  # exact GELU
    assert apply_fused_gelu_mlp(FeedForward(16, activation_fn="geglu")) == 0
    x = torch.randn(2, 5, 16)
    ref_dx, ref_grads = grads_of(reference, x)
    dx, grads = grads_of(fused, x)
    assert_same_gradients((dx, grads), (ref_dx, ref_grads))


def test_a_compiled_diffusers_feed_forward_runs_the_fused_op():
    from diffusers.models.attention import FeedForward

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = FeedForward(16, activation_fn="gelu-approximate")
    fused = copy.deepcopy(reference)
    apply_fused_gelu_mlp(fused)
    counter = CompileCounterWithBackend("aot_eager")
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(torch.compile(fused, backend=counter)(x), reference(x))
    assert traced_ops(counter).count("litegen.gelu_mlp.default") == 1
    torch._dynamo.reset()
