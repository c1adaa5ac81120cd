"""Fused GELU MLPs on CUDA: cuBLASLt's epilogues against torch's ops (skipped without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from litegen.compile import compile_blocks
from litegen.experimental.cublaslt import dgelu, gelu_aux_bias
from litegen.experimental.fused_gelu_mlp import apply_fused_gelu_mlp
from litegen.utils.config import CompileConfig
from litegen_zoo.dit_model import DiT, DiTConfig, sample_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 outputs of K=1152..4608 reductions: compare at bf16's resolution.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_gelu_aux_bias_gives_the_pre_activation_and_its_tanh_gelu():
    x, w, b = randn(512, 1152), randn(4608, 1152, scale=0.03), randn(4608, scale=0.1)
    result = gelu_aux_bias(x, w, b)
    assert result is not None, "cuBLASLt offered no GELU_AUX_BIAS algorithm"
    pre, h = result
    expected = F.linear(x.float(), w.float(), b.float())
    close(pre, expected)
    close(h, F.gelu(expected, approximate="tanh"))


def test_dgelu_gives_the_gradient_through_the_second_linear_and_the_gelu():
    grad_y, w2 = randn(512, 1152), randn(1152, 4608, scale=0.03)
    pre = randn(512, 4608)
    grad_pre = dgelu(grad_y, w2, pre)
    assert grad_pre is not None, "cuBLASLt offered no DGELU algorithm"
    expected = torch.ops.aten.gelu_backward(
        grad_y.float() @ w2.float(), pre.float(), approximate="tanh"
    )
    close(grad_pre, expected)


def test_compiled_dit_with_fused_mlps_matches_eager_under_autocast():
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = DiTConfig(hidden=256, depth=2, heads=4, num_classes=10)
    eager = DiT(cfg).cuda()
    fused = copy.deepcopy(eager)
    assert apply_fused_gelu_mlp(fused) == cfg.depth
    compile_blocks(fused, CompileConfig(enabled=True))
    results = []
    for model in (eager, fused):
        x, t = sample_batch(cfg, 4, 64, "cuda")
        with torch.autocast("cuda", torch.bfloat16):
            loss = (model(x, t).float() - x).square().mean()
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-3)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=5e-2, atol=5e-3, msg=name)
    torch._dynamo.reset()


def test_frozen_fused_mlp_gives_the_input_gradient_of_the_unfused_one():
    # A LoRA run's base MLP: the DGELU GEMM and the input gradient's, no weight gradients.
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    reference = FeedForward(1536, activation_fn="gelu-approximate").cuda().requires_grad_(False)
    fused = copy.deepcopy(reference)
    assert apply_fused_gelu_mlp(fused) == 1
    x = randn(1, 1024, 1536)
    results = []
    for model in (reference, torch.compile(fused)):
        x_ = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            y = model(x_)
        y.float().square().mean().backward()
        results.append((y, x_.grad))
    (ref_y, ref_dx), (y, dx) = results
    close(y, ref_y)
    error = (dx.float() - ref_dx.float()).norm() / ref_dx.float().norm()
    assert error < 2e-2, error
    assert all(p.grad is None for p in fused.parameters())
    torch._dynamo.reset()
