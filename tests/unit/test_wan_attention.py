"""Wan's fused self-attention (``optimization.experimental.fused_wan_attention``) on CPU.

* the Triton norm-and-rotary kernels, run by Triton's interpreter, against autograd through
  the op's torch formula (``qk_norm_rope.reference``);
* the processor on a tiny diffusers Wan against diffusers' own, in FP32: the same outputs and
  gradients, the same ``state_dict``, cross-attention and uncovered calls left to diffusers;
* the switch through ``Lab`` and ``prepare``.

tests/gpu/test_wan_attention_gpu.py runs the kernels on CUDA, compiled in a Wan model.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import litegen
from litegen import experimental
from litegen.config import ExperimentalConfig, MainConfig
from litegen.experimental import TESTED_TORCH, Lab, torch_release

pytest.importorskip("triton")

from litegen.experimental.fused_gelu_mlp import is_fused
from litegen.experimental.qk_norm_rope import qk_norm_rope, reference
from litegen.experimental.wan_attention import (
    FusedWanSelfAttention,
    _shared_lora_adapters,
    apply_fused_wan_attention,
)
from litegen_zoo.real_models import REAL_MODELS

CHILD = r"""
import torch
from litegen.experimental.qk_norm_rope import qk_norm_rope, reference

def check(batch, freq_batch, heads, head, dtype, sliced=False):
    torch.manual_seed(0)
    tokens, width = 5, heads * head
    x = torch.randn(batch, tokens, 3 * width if sliced else width).to(dtype)
    if sliced:  # the key's third of one QKV projection: rows one stride apart, no copy
        x = x.chunk(3, dim=-1)[1]
    weight = (1 + 0.1 * torch.randn(width)).to(dtype)
    angles = torch.randn(freq_batch, tokens, 1, head)
    cos, sin = angles.cos(), angles.sin()
    grad = torch.randn(batch, tokens, width).to(dtype)
    results = []
    for op in (qk_norm_rope, reference):
        # A leaf with x's strides: clone() would make a sliced x contiguous.
        xi = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
        xi, wi = xi.requires_grad_(), weight.clone().requires_grad_()
        y = op(xi, wi, cos, sin, 1e-6)
        results.append((y, *torch.autograd.grad(y, (xi, wi), grad)))
    # The interpreter rounds to bf16 by truncation (NumPy has no bf16): one bf16 step.
    bf16 = dtype == torch.bfloat16
    tolerance = dict(rtol=1.6e-2, atol=1.6e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours.float(), theirs.float(), **tolerance)

check(2, 1, 3, 8, torch.float32)     # half a row of 12 pairs: a masked block of 16
check(2, 2, 2, 16, torch.float32)    # angles per sample
check(1, 1, 4, 8, torch.bfloat16)
check(2, 1, 3, 8, torch.float32, sliced=True)
print("ok")
"""


def test_the_kernels_match_autograd_through_the_formula(triton_interpreter):
    assert triton_interpreter("-c", CHILD).strip().endswith("ok")


def test_the_formula_is_rms_norm_then_diffusers_rotation():
    torch.manual_seed(0)
    x, weight = torch.randn(2, 3, 8), torch.randn(8)
    angles = torch.randn(1, 3, 1, 4)
    cos, sin = angles.cos(), angles.sin()
    y = torch.nn.functional.rms_norm(x, (8,), weight, 1e-6).view(2, 3, 2, 4)
    x1, x2 = y.unflatten(-1, (-1, 2)).unbind(-1)
    expected = torch.empty_like(y)
    expected[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
    expected[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
    torch.testing.assert_close(reference(x, weight, cos, sin, 1e-6), expected.view(2, 3, 8))
    torch.testing.assert_close(qk_norm_rope(x, weight, cos, sin, 1e-6), expected.view(2, 3, 8))


def tiny_wan(**overrides):
    return REAL_MODELS["wan"].build("tiny", num_layers=2, **overrides)


def run(model, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(2, 4, 3, 4, 4)
    text = torch.randn(2, 6, model.config.text_dim)
    out = model(x, timestep=torch.tensor([100.0, 700.0]), encoder_hidden_states=text)[0]
    out.square().mean().backward()
    return out


def test_the_processor_computes_what_diffusers_does():
    model = tiny_wan()
    fused = copy.deepcopy(model)
    assert apply_fused_wan_attention(fused) == 2
    assert apply_fused_wan_attention(fused) == 2  # idempotent
    for block in fused.blocks:
        assert isinstance(block.attn1.processor, FusedWanSelfAttention)
        assert not isinstance(block.attn2.processor, FusedWanSelfAttention)  # cross-attention
    assert list(fused.state_dict()) == list(model.state_dict())
    torch.testing.assert_close(run(fused), run(model))
    for (name, p), q in zip(model.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_calls_it_does_not_cover_run_diffusers_processor():
    attn = tiny_wan().blocks[0].attn1
    original = attn.processor
    apply_fused_wan_attention(attn)
    x = torch.randn(1, 5, attn.to_q.in_features)
    mask = torch.zeros(1, 1, 5, 5)
    for call in (
        {"attention_mask": mask, "rotary_emb": (torch.ones(1, 5, 1, 16), torch.zeros(1, 5, 1, 16))},
        {},  # no rotary embedding
    ):
        torch.testing.assert_close(attn(x, **call), original(attn, x, **call))


@pytest.fixture
def tested_here(monkeypatch):
    monkeypatch.setattr(experimental, "_warned", set())
    monkeypatch.setitem(TESTED_TORCH, "fused_wan_attention", (torch_release(),))


def test_lab_swaps_wan_and_warns_when_a_model_has_none(tested_here, caplog):
    lab = Lab(ExperimentalConfig(fused_wan_attention=True))
    assert lab.swap_modules(tiny_wan()) == 2
    with caplog.at_level(logging.WARNING, logger="litegen"):
        assert lab.swap_modules(torch.nn.Linear(2, 2)) == 0
    assert "fused_wan_attention" in caplog.text and "nothing was fused" in caplog.text


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_prepare_trains_wan_with_the_switches_like_without(
    tested_here, monkeypatch, tmp_path, lora
):
    # The fine-tuning settings together: LoRA on the projections, the fused attention and the
    # fused GELU MLP (torch's kernels on the CPU) give the losses of the plain model.
    monkeypatch.setitem(TESTED_TORCH, "fused_gelu_mlp", (torch_release(),))
    if lora:
        pytest.importorskip("peft")
    losses = []
    for switch in (False, True):
        optimization = {"experimental": {"fused_wan_attention": switch, "fused_gelu_mlp": switch}}
        if lora:
            optimization["lora"] = {"rank": 4, "alpha": 8, "target_modules": LORA_TARGETS}
        config = {
            "results_dir": str(tmp_path / str(switch)),
            "runtime": {"device": "cpu"},
            "optimization": optimization,
        }
        gen = litegen.initialize(MainConfig.from_dict(config))
        model = tiny_wan()
        model, optimizer = gen.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        fused = [b.attn1.processor for b in model.blocks]
        assert all(isinstance(p, FusedWanSelfAttention) for p in fused) == switch
        assert all(is_fused(b.ffn) for b in model.blocks) == switch
        run_losses = []
        for step in range(3):
            optimizer.zero_grad()
            out = run(model, seed=step)
            run_losses.append(out.square().mean().item())
            optimizer.step()
        losses.append(run_losses)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def test_angles_for_other_tokens_are_an_error_naming_the_shapes():
    x, weight = torch.randn(2, 3, 8), torch.ones(8)
    angles = torch.randn(1, 4, 1, 4)  # 4 tokens of angles for 3 tokens
    with pytest.raises(ValueError, match=r"cos and sin must be \(1 or 2, 3, 1, head_dim\)"):
        qk_norm_rope(x, weight, angles.cos(), angles.sin(), 1e-6)


def lora_wan(**lora):
    peft = pytest.importorskip("peft")
    config = {"r": 4, "target_modules": ["to_q", "to_k", "to_v"], "init_lora_weights": False}
    return peft.get_peft_model(tiny_wan(), peft.LoraConfig(**(config | lora)))


def assert_trains_like_peft(model: torch.nn.Module) -> None:
    fused = copy.deepcopy(model)
    assert apply_fused_wan_attention(fused) == 2
    torch.testing.assert_close(run(fused), run(model))
    adapters = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    assert adapters
    fused_grads = dict(fused.named_parameters())
    for name, p in adapters:
        torch.testing.assert_close(fused_grads[name].grad, p.grad, msg=name)


@pytest.mark.parametrize("alpha", [4, 12], ids=["scale_1", "scale_3"])
def test_lora_adapters_on_the_projections_run_fused_and_train_like_peft(alpha):
    model = lora_wan(lora_alpha=alpha)
    attn = model.base_model.model.blocks[0].attn1
    assert _shared_lora_adapters((attn.to_q, attn.to_k, attn.to_v)) == ("default",)
    assert_trains_like_peft(model)


def test_lora_layers_the_fused_gemms_cannot_serve_run_as_their_own_modules():
    for model in (lora_wan(lora_dropout=0.1), lora_wan(use_dora=True)):
        attn = model.base_model.model.blocks[0].attn1
        assert _shared_lora_adapters((attn.to_q, attn.to_k, attn.to_v)) is None
    model = lora_wan(use_dora=True)
    assert_trains_like_peft(model)


def test_compiled_lora_wan_runs_the_fused_projection_in_one_graph_per_block():
    from torch._dynamo.testing import CompileCounterWithBackend

    from litegen.compile import compile_blocks
    from litegen.utils.config import CompileConfig

    torch._dynamo.reset()
    model = lora_wan()
    fused = copy.deepcopy(model)
    apply_fused_wan_attention(fused)
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(fused.base_model.model, CompileConfig(enabled=True), backend=counter)
    torch.testing.assert_close(run(fused), run(model))
    # One block graph (the second block's input needs a gradient: a second graph), no breaks.
    assert counter.frame_count == 2
    block_diagonal = [
        node
        for graph in counter.graphs
        for node in graph.graph.nodes
        if node.op == "call_function" and node.target is torch.block_diag
    ]
    assert len(block_diagonal) == 2
    torch._dynamo.reset()


def test_fp32_adapters_on_a_bf16_base_without_autocast_promote_as_peft_does():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_wan().to(torch.bfloat16), config)  # adapters stay FP32
    attn = model.base_model.model.blocks[0].attn1
    assert attn.to_q.lora_A["default"].weight.dtype == torch.float32
    fused = copy.deepcopy(attn)
    apply_fused_wan_attention(fused)
    x = torch.randn(1, 12, attn.to_q.in_features, dtype=torch.bfloat16)
    angles = torch.randn(1, 12, 1, attn.to_q.out_features // attn.heads)
    rotary = (angles.cos(), angles.sin())
    expected = attn(x, rotary_emb=rotary)
    out = fused(x, rotary_emb=rotary)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1.6e-2)
