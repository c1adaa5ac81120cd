"""Wan's fused self-attention on CUDA: the Triton norm-and-rotary op and the processor, compiled."""

from __future__ import annotations

import copy

import pytest
import torch

from litegen.compile import compile_blocks
from litegen.experimental.qk_norm_rope import qk_norm_rope, reference
from litegen.experimental.wan_attention import apply_fused_wan_attention
from litegen.utils.config import CompileConfig
from litegen_zoo.real_models import REAL_MODELS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def rotary(tokens: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = (torch.rand(1, tokens, 1, head // 2, device="cuda") * 6.28).repeat_interleave(2, -1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,tokens,heads,head", [(1, 4099, 12, 128), (2, 300, 3, 40)])
def test_kernel_matches_torch_forward_and_backward(dtype, batch, tokens, heads, head):
    torch.manual_seed(0)
    width = heads * head
    # A slice of a wider projection, as the processor passes the query and the key.
    x = torch.randn(batch, tokens, 3 * width, device="cuda").to(dtype)[..., width : 2 * width]
    weight = (1 + 0.1 * torch.randn(width, device="cuda")).to(dtype)
    cos, sin = rotary(tokens, head)
    grad = torch.randn_like(x)
    results = []
    for op in (qk_norm_rope, reference):
        # A leaf with x's strides: clone() would make a sliced x contiguous.
        xi = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
        xi, wi = xi.requires_grad_(), weight.clone().requires_grad_()
        y = op(xi, wi, cos, sin, 1e-6)
        results.append((y, *torch.autograd.grad(y, (xi, wi), grad)))
    # One bf16 rounding of FP32 results; the weight's gradient sums thousands of rows in
    # another order.
    tolerance = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    for ours, theirs in zip(results[0][:2], results[1][:2], strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), **tolerance)
    grad_w, expected = results[0][2].float(), results[1][2].float()
    assert (grad_w - expected).norm() / expected.norm() < (
        1e-2 if dtype == torch.bfloat16 else 1e-5
    )


def test_compiled_wan_with_the_fused_processor_trains_like_diffusers():
    torch.manual_seed(0)
    spec = REAL_MODELS["wan"]
    model = spec.build("tiny", num_layers=2, attention_head_dim=32).cuda()
    fused = copy.deepcopy(model)
    assert apply_fused_wan_attention(fused) == 2
    for m in (model, fused):
        compile_blocks(m, CompileConfig(enabled=True))
    x = torch.randn(2, 4, 3, 8, 8, device="cuda")
    text = torch.randn(2, 6, model.config.text_dim, device="cuda")
    t = torch.tensor([100.0, 700.0], device="cuda")
    outs = []
    for m in (model, fused):
        with torch.autocast("cuda", torch.bfloat16):
            out = m(x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        out.float().square().mean().backward()
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(model.named_parameters(), fused.parameters(), strict=True):
        assert q.grad is not None, name
        relative = (q.grad - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
        assert relative < 2e-2, (name, relative.item())


def test_compiled_lora_wan_with_the_fused_processor_trains_like_peft():
    # One GEMM each way for the three projections and one for their adapters, compiled, bf16
    # adapters as the bf16-mixed preset keeps them: adapter gradients within bf16 rounding.
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = REAL_MODELS["wan"].build("tiny", num_layers=2, attention_head_dim=32)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False
    )
    model = peft.get_peft_model(base, config).cuda().to(torch.bfloat16)
    fused = copy.deepcopy(model)
    assert apply_fused_wan_attention(fused) == 2
    for m in (model, fused):
        compile_blocks(m.base_model.model, CompileConfig(enabled=True))
    x = torch.randn(2, 4, 3, 8, 8, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(2, 6, base.config.text_dim, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([100.0, 700.0], device="cuda")
    outs = []
    for m in (model, fused):
        out = m(x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        out.float().square().mean().backward()
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=3e-2, atol=3e-2)
    adapters = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    assert adapters
    fused_parameters = dict(fused.named_parameters())
    for name, p in adapters:
        grad = fused_parameters[name].grad.float()
        relative = (grad - p.grad.float()).norm() / p.grad.float().norm().clamp_min(1e-12)
        assert relative < 3e-2, (name, relative.item())
    torch._dynamo.reset()
