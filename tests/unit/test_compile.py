"""Regional compilation: same numbers as eager, one region per block, bounded recompiles.

Inductor's C++ code generation takes minutes on a small CPU, so these tests compile with
``backend="aot_eager"`` (Dynamo + AOTAutograd: the same graphs and guards, run eagerly) or, for
counting recompiles, ``"eager"`` (Dynamo only). ``tests/gpu/test_perf_gpu.py`` runs inductor.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._inductor import config as inductor_config

from litegen.compile import compile_blocks, compile_kwargs, inductor_options, is_compiled
from litegen.memory import apply_memory_optimizations
from litegen.utils.config import CompileConfig, MemoryConfig
from litegen_zoo.dit_model import DiT, DiTConfig, sample_batch

TINY = DiTConfig(hidden=32, depth=3, heads=2, num_classes=10)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make(checkpoint: bool = False) -> DiT:
    torch.manual_seed(0)
    model = DiT(TINY)
    if checkpoint:
        memory = {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.0}}
        apply_memory_optimizations(model, MemoryConfig.model_validate(memory))
    return model


def loss_and_grads(model: DiT, tokens: int = 16) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, t = sample_batch(model.cfg, batch=2, tokens=tokens, device="cpu")
    loss = (model(x, t) - x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("checkpoint", [False, True])
def test_compiled_blocks_match_eager_and_keep_names(checkpoint: bool):
    eager = make(checkpoint)
    compiled = make(checkpoint)
    keys = list(compiled.state_dict())
    params = {n: id(p) for n, p in compiled.named_parameters()}
    counter = CompileCounterWithBackend("aot_eager")
    cfg = CompileConfig(enabled=True, dynamic=None)
    paths = compile_blocks(compiled, cfg, backend=counter)

    assert paths == ["blocks.0", "blocks.1", "blocks.2"]
    assert sum(is_compiled(m) for m in compiled.modules()) == TINY.depth
    assert list(compiled.state_dict()) == keys
    assert {n: id(p) for n, p in compiled.named_parameters()} == params
    ref_loss, ref_grads = loss_and_grads(eager)
    loss, grads = loss_and_grads(compiled)
    assert counter.frame_count == 1  # the blocks share one forward, so one graph serves all
    torch.testing.assert_close(loss, ref_loss)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def saved_bytes_and_grads(model: DiT) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes the forward saves for backward, and the gradients."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, grads = loss_and_grads(model)
    return saved, grads


def test_a_memory_budget_makes_compiled_blocks_save_less_with_the_same_gradients():
    # aot_eager_decomp_partition splits forward and backward with the min-cut partitioner,
    # the one inductor uses and the one the budget steers.
    runs = {}
    for budget in (None, 0.0):
        model = make()
        cfg = CompileConfig(enabled=True, dynamic=False)
        compile_blocks(model, cfg, backend="aot_eager_decomp_partition", memory_budget=budget)
        runs[budget] = saved_bytes_and_grads(model)
        torch._dynamo.reset()
    (default_bytes, default_grads), (lean_bytes, lean_grads) = runs[None], runs[0.0]
    assert lean_bytes < 0.8 * default_bytes
    for name, grad in default_grads.items():
        torch.testing.assert_close(lean_grads[name], grad, msg=name)


def test_variable_sequence_lengths_recompile_at_most_twice():
    model = make()
    counter = CompileCounter()
    compile_blocks(model, CompileConfig(enabled=True, dynamic=None), backend=counter)
    for tokens in (16, 24, 40, 56):
        loss_and_grads(model, tokens)
    assert counter.frame_count <= 3  # the static first shape plus at most two recompiles


def test_dynamic_false_specialises_on_every_shape():
    # The contrast that shows the test above can fail: static shapes recompile per length.
    model = make()
    counter = CompileCounter()
    compile_blocks(model, CompileConfig(enabled=True, dynamic=False), backend=counter)
    for tokens in (16, 24, 40):
        loss_and_grads(model, tokens)
    assert counter.frame_count == 3


def graphs_under_ddp(compile_fn) -> int:
    """Graphs Dynamo hands its backend for the blocks of a DDP model with 1 MB buckets."""
    torch.manual_seed(0)
    model = DiT(DiTConfig(hidden=256, depth=2, heads=4, num_classes=10))  # 4.7 MB per block
    counter = CompileCounter()
    compile_fn(model, counter)
    # DDP's smallest buckets: DDPOptimizer, when on, cuts each block's graph into about 5.
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    x, t = sample_batch(model.cfg, batch=2, tokens=16, device="cpu")
    (ddp(x, t) - x).square().mean().backward()
    return counter.frame_count


def test_compiled_blocks_stay_one_graph_under_ddp(group):
    def by_hand(model: DiT, backend) -> None:
        for block in model.blocks:
            block.forward = torch.compile(block.forward, backend=backend)

    def by_litegen(model: DiT, backend) -> None:
        compile_blocks(model, CompileConfig(enabled=True), backend=backend)

    def whole_model(model: DiT, backend) -> None:
        compile_blocks(model, CompileConfig(enabled=True), paths=[""], backend=backend)

    # The same blocks compiled by hand are cut into pieces (the contrast: the check can fail).
    assert graphs_under_ddp(by_hand) > 2
    torch._dynamo.reset()
    assert graphs_under_ddp(by_litegen) == 1
    torch._dynamo.reset()
    # A model compiled whole keeps the cuts: only they let its all-reduces overlap its backward.
    assert graphs_under_ddp(whole_model) > 1


def test_compiling_twice_is_a_no_op_and_compiles_inside_the_checkpointed_forward():
    model = make(checkpoint=True)
    checkpointed_forward = model.blocks[0].forward
    cfg = CompileConfig(enabled=True)
    assert len(compile_blocks(model, cfg, backend="aot_eager")) == TINY.depth
    assert compile_blocks(model, cfg, backend="aot_eager") == []
    # The block keeps its checkpointing wrapper, which now runs compiled code in each mode.
    assert model.blocks[0].forward is checkpointed_forward and is_compiled(model.blocks[0])


def test_model_without_repeated_blocks_compiles_its_forward():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert compile_blocks(model, CompileConfig(enabled=True), backend="aot_eager") == [""]
    assert is_compiled(model)
    torch.testing.assert_close(model(torch.ones(2, 4)), model.forward.original(torch.ones(2, 4)))


def test_inductor_options_are_checked_by_name_and_type_and_exclude_mode():
    options = {"coordinate_descent_tuning": True}
    paths = compile_blocks(make(), CompileConfig(enabled=True, options=options))
    assert paths == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(ValueError, match=r"options: Unexpected optimization option no_such"):
        compile_blocks(make(), CompileConfig(enabled=True, options={"no_such": 1}))
    with pytest.raises(ValueError, match=r"options: Unexpected type of attr"):
        compile_blocks(make(), CompileConfig(enabled=True, options={"debug": "yes"}))
    with pytest.raises(ValueError, match=r"only with mode: default"):
        compile_blocks(make(), CompileConfig(enabled=True, mode="max-autotune", options=options))


def test_nested_inductor_options_become_dotted_names():
    nested = {"triton": {"tile_reductions": True}, "post_grad_fusion_options": {}}
    assert inductor_options(nested) == {
        "triton.tile_reductions": True,
        "post_grad_fusion_options": {},  # an option whose value is a dict stays whole
    }
    compiled = compile_blocks(make(), CompileConfig(enabled=True, options=nested))
    assert compiled == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(ValueError, match=r"options: Unexpected optimization option triton.no"):
        compile_blocks(make(), CompileConfig(enabled=True, options={"triton": {"no": 1}}))


def test_mode_needs_inductor():
    with pytest.raises(ValueError, match="inductor"):
        compile_blocks(make(), CompileConfig(enabled=True, mode="max-autotune"), backend="eager")


@pytest.mark.skipif(
    not hasattr(inductor_config.triton, "mix_order_reduction"),
    reason="this torch has no mix-order reduction",
)
def test_inductor_compiles_without_mix_order_reduction_unless_the_user_turns_it_on(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION", raising=False)
    off = {"triton.mix_order_reduction": False}
    assert compile_kwargs(CompileConfig(enabled=True)) == {"dynamic": False, "options": off}
    # torch.compile takes a mode or options: the mode is passed as the options it stands for
    tuned = compile_kwargs(CompileConfig(enabled=True, mode="max-autotune-no-cudagraphs"))
    assert "mode" not in tuned
    assert tuned["options"] == {"max_autotune": True, "coordinate_descent_tuning": True} | off
    on = {"triton": {"mix_order_reduction": True}}
    assert compile_kwargs(CompileConfig(enabled=True, options=on))["options"] == {
        "triton.mix_order_reduction": True
    }
    assert "options" not in compile_kwargs(CompileConfig(enabled=True), backend="aot_eager")
    monkeypatch.setenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION", "1")
    assert "options" not in compile_kwargs(CompileConfig(enabled=True))


def lora_model() -> DiT:
    """The tiny DiT with peft LoRA adapters in its attention, as the fine-tuning recipes train."""
    pytest.importorskip("peft")
    from litegen.config.sections import LoRAConfig
    from litegen.lora import apply_lora

    model = make()
    apply_lora(model, LoRAConfig(rank=4, target_modules=["qkv", "proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; a nonzero one makes the adapters count
            torch.nn.init.normal_(param, std=0.1)
    return model


def test_blocks_with_lora_adapters_compile_as_one_graph_and_match_eager():
    eager, compiled = lora_model(), lora_model()
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(compiled, CompileConfig(enabled=True, dynamic=None), backend=counter)
    ref_loss, ref_grads = loss_and_grads(eager)
    loss, grads = loss_and_grads(compiled)
    # peft's layers trace without a graph break; the first block's input needs no gradient
    # (the base is frozen), the others' do, so the one forward has two graphs.
    assert counter.frame_count == 2
    assert any("lora_A" in name for name in grads)
    torch.testing.assert_close(loss, ref_loss)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_blocks_with_lora_adapters_recompile_at_most_twice_over_bucket_shapes():
    model = lora_model()
    counter = CompileCounter()
    compile_blocks(model, CompileConfig(enabled=True, dynamic=None), backend=counter)
    for tokens in (16, 24, 40, 56):
        loss_and_grads(model, tokens)
    frames = counter.frame_count
    # Per input kind (no gradient: the first block; gradient: the others), the static first
    # shape and one dynamic recompile; without dynamic marking, every shape would compile.
    assert frames <= 4, frames


@pytest.mark.parametrize(
    "enabled, device, wanted",
    [(True, "cpu", True), (False, "cuda", False), ("auto", "cuda", True), ("auto", "cpu", False)],
)
def test_auto_compiles_on_cuda_only(enabled, device, wanted):
    from types import SimpleNamespace

    from litegen.compile import compile_wanted

    assert compile_wanted(SimpleNamespace(enabled=enabled), torch.device(device)) is wanted
