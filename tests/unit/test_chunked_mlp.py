"""Chunked GELU MLPs (``optimization.memory.mlp_chunk_tokens``) on CPU.

They must compute what the plain MLP computes, forward and backward, at any chunk size; keep
nothing of the MLP's hidden width for backward; trace into one compiled graph; and reach the
model through ``prepare`` (with checkpointing, under every strategy:
``tests/distributed/test_real_models.py``).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.flop_counter import FlopCounterMode

import litegen
from litegen.compile import compile_blocks
from litegen.memory import apply_memory_optimizations
from litegen.memory.mlp_token_chunks import apply_chunked_mlp, is_chunked
from litegen.utils.config import CompileConfig, MainConfig, MemoryConfig
from tests.unit.test_gelu_mlp import (
    TINY,
    DiT,
    assert_compiled_dit_runs_op_like_eager,
    assert_same_gradients,
    grads_of,
    sequential_mlp,
    traced_ops,
)

HIDDEN = 64  # sequential_mlp's inner width


def diffusers_feed_forward() -> nn.Module:
    from diffusers.models.attention import FeedForward

    return FeedForward(16, inner_dim=HIDDEN, activation_fn="gelu-approximate")


@pytest.mark.parametrize("chunk", [1, 3, 10, 64])  # one row; uneven; exactly the rows; one chunk
@pytest.mark.parametrize("make", [sequential_mlp, diffusers_feed_forward], ids=["seq", "diffusers"])
def test_chunked_mlp_computes_what_the_plain_one_does(make, chunk):
    torch.manual_seed(0)
    reference = make()
    chunked = copy.deepcopy(reference)
    keys = list(chunked.state_dict())
    assert apply_chunked_mlp(chunked, chunk) == 1 and is_chunked(chunked)
    assert list(chunked.state_dict()) == keys
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    reference.double(), chunked.double()
    ref_dx, ref_grads = grads_of(reference, x)
    dx, grads = grads_of(chunked, x)
    assert ref_grads["loss"] != 0
    assert_same_gradients((dx, grads), (ref_dx, ref_grads))


def saved_shapes(model: nn.Module, x: torch.Tensor) -> list[torch.Size]:
    shapes: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x.requires_grad_())
    return shapes


def test_only_the_input_and_weights_are_saved_for_backward():
    torch.manual_seed(0)
    reference = sequential_mlp()
    chunked = copy.deepcopy(reference)
    apply_chunked_mlp(chunked, 4)
    x = torch.randn(12, 16)
    # The plain MLP keeps its pre-activation (and the GELU output for the second linear).
    assert sum(shape == (12, HIDDEN) for shape in saved_shapes(reference, x)) >= 2
    kept = saved_shapes(chunked, x)
    assert torch.Size([12, 16]) in kept
    assert all(shape[0] != 12 or shape[-1] != HIDDEN for shape in kept), kept


def test_under_autocast_it_matches_the_plain_mlp_under_autocast():
    torch.manual_seed(0)
    reference = sequential_mlp()
    chunked = copy.deepcopy(reference)
    apply_chunked_mlp(chunked, 5)
    x = torch.randn(2, 6, 16)
    with torch.autocast("cpu", torch.bfloat16):
        ref_dx, ref_grads = grads_of(reference, x)
        dx, grads = grads_of(chunked, x)
    # Weight gradients are summed over the chunks in FP32 from bf16 products.
    assert_same_gradients((dx, grads), (ref_dx, ref_grads), rtol=2e-2, atol=2e-3)


def test_a_chunked_mlp_survives_deepcopy_and_pickling_and_keeps_its_chunk():
    model = sequential_mlp()
    apply_chunked_mlp(model, 3)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    x = torch.randn(7, 16)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert is_chunked(copied) and type(copied) is type(model)
        assert type(copied).__name__ == "ChunkedSequential"
        torch.testing.assert_close(copied(x), model(x))
    assert apply_chunked_mlp(model, 5) == 1 and model._litegen_mlp_chunk_tokens == 5


def test_changed_mlps_and_other_activations_run_their_own_forward():
    assert apply_chunked_mlp(sequential_mlp(nn.GELU()), 4) == 0  # exact GELU
    torch.manual_seed(0)
    reference = sequential_mlp()
    chunked = copy.deepcopy(reference)
    apply_chunked_mlp(chunked, 4)
    for model in (reference, chunked):  # e.g. a hook arriving after prepare
        model[0].register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(6, 16)
    torch.testing.assert_close(chunked(x), reference(x))


def test_flops_are_counted_as_for_the_plain_mlp():
    reference = sequential_mlp()
    chunked = copy.deepcopy(reference)
    apply_chunked_mlp(chunked, 3)
    counts = []
    for model in (reference, chunked):
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(8, 16, requires_grad=True)).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_checkpointed_compiled_blocks_with_chunked_mlps_match_eager_in_one_graph():
    memory = MemoryConfig(
        activation_checkpoint={"enabled": True, "selective_ratio": 0}, mlp_chunk_tokens=5
    )

    def chunk_mlps(model: nn.Module) -> None:
        report = apply_memory_optimizations(model, memory)
        assert report.chunked_mlps == TINY.depth and len(report.checkpointed) == TINY.depth
        assert "3 GELU MLPs run in chunks of tokens" in report.describe()

    assert_compiled_dit_runs_op_like_eager(chunk_mlps, "litegen.chunked_gelu_mlp.default")


def test_prepare_chunks_the_mlps_and_refuses_the_fused_mlp_beside_it(tmp_path):
    base = {"results_dir": str(tmp_path), "runtime": {"device": "cpu"}, "global_batch_size": 2}
    config = MainConfig.from_dict(base | {"optimization": {"memory": {"mlp_chunk_tokens": 8}}})
    gen = litegen.initialize(config)
    model = gen.prepare(DiT(TINY))
    chunked = [name for name, m in gen.unwrap(model).named_modules() if is_chunked(m)]
    assert chunked == [f"blocks.{i}.mlp" for i in range(TINY.depth)]
    assert gen.models[0].memory.describe() == "3 GELU MLPs run in chunks of tokens"
    both = {"memory": {"mlp_chunk_tokens": 8}, "experimental": {"fused_gelu_mlp": True}}
    with pytest.raises(ValueError, match="keep mlp_chunk_tokens for memory, or fused_gelu_mlp"):
        MainConfig.from_dict(base | {"optimization": both})


def test_a_compiled_diffusers_model_runs_its_mlps_chunked():
    from litegen_zoo.real_models import REAL_MODELS

    torch._dynamo.reset()
    spec = REAL_MODELS["wan"]
    eager = spec.build("tiny")
    compiled = copy.deepcopy(eager)
    memory = MemoryConfig(
        activation_checkpoint={"enabled": True, "selective_ratio": 0}, mlp_chunk_tokens=5
    )
    assert apply_memory_optimizations(compiled, memory).chunked_mlps == len(compiled.blocks)
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(compiled, CompileConfig(enabled=True), backend=counter)
    batch = spec.batch("tiny", batch_size=2, seed=0)
    losses = []
    for model in (eager, compiled):
        loss = spec.loss(model, batch)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0])
    assert traced_ops(counter).count("litegen.chunked_gelu_mlp.default") == 1  # blocks share it
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    torch._dynamo.reset()
