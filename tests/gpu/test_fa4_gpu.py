"""FA4 as torch's flash SDPA kernels (litegen.kernels.fa4) on a Hopper or Blackwell GPU.

Needs the ``flash-attn-4`` package; skipped without it, without CUDA, or on other GPUs.

    python3 -m pytest tests/gpu/test_fa4_gpu.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from litegen.kernels.attention import FA4_MAJORS, activate_fa4, attention_context
from litegen.kernels.fa4 import CUDNN_FORWARD_MAX_TOKENS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or torch.cuda.get_device_capability()[0] not in FA4_MAJORS
        or importlib.util.find_spec("flash_attn") is None
        or importlib.util.find_spec("flash_attn.cute") is None,
        reason="needs a Hopper/Blackwell GPU and the flash-attn-4 package",
    ),
]
DEVICE = torch.device("cuda")


def attend(qkv: torch.Tensor, backend: str, dout: torch.Tensor):
    """Output and packed-qkv gradient of attention over a (batch, tokens, 3, heads, dim) tensor."""
    qkv = qkv.detach().requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    with attention_context(backend, DEVICE):
        out = F.scaled_dot_product_attention(q, k, v)
        out.backward(dout.to(out.dtype))
    return out.detach().float(), qkv.grad.float()


# On Hopper, 1024 tokens take cuDNN's forward with FA4's backward, 2048 FA4's kernels only.
@pytest.mark.parametrize("tokens", [1024, 2048])
@pytest.mark.parametrize("head_dim", [72, 64, 128, 40])
def test_fa4_output_and_gradients_match_fp32_math(head_dim, tokens):
    assert activate_fa4(DEVICE)
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    qkv = torch.randn(
        2, tokens, 3, 16, head_dim, device=DEVICE, generator=gen, dtype=torch.bfloat16
    )
    dout = torch.randn(2, 16, tokens, head_dim, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    ref_out, ref_grad = attend(qkv.float(), "math", dout.float())
    out, grad = attend(qkv, "flash_attn", dout)
    cudnn_out, cudnn_grad = attend(qkv, "cudnn", dout)
    # Within twice cuDNN's bf16 error, and small in absolute terms.
    for got, cudnn, ref in ((out, cudnn_out, ref_out), (grad, cudnn_grad, ref_grad)):
        error = (got - ref).abs().max().item()
        assert error <= max(2 * (cudnn - ref).abs().max().item(), 1e-3) and error < 0.02


def test_short_sequences_in_any_layout_keep_cudnns_forward_right():
    """Packed views, then contiguous copies, then packed again: cuDNN keeps a plan per shape, and
    its backward once reused the first layout's plan for the second (bench_fa4.py ``layouts``)."""
    assert activate_fa4(DEVICE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(4, 256, 3, 16, 72, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    dout = torch.randn(4, 16, 256, 72, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    ref_out, ref_grad = attend(qkv.float(), "math", dout.float())
    for contiguous in (False, True, False):
        q, k, v = (t.detach().requires_grad_() for t in qkv.permute(2, 0, 3, 1, 4))
        inputs = [t.contiguous() for t in (q, k, v)] if contiguous else [q, k, v]
        with attention_context("flash_attn", DEVICE):
            out = F.scaled_dot_product_attention(*inputs)
            out.backward(dout)
        grad = torch.stack([q.grad, k.grad, v.grad], dim=2).transpose(1, 3).float()
        assert (out.float() - ref_out).abs().max().item() < 0.02
        assert (grad - ref_grad).abs().max().item() < 0.02


@pytest.mark.parametrize("tokens", [512, 2048])
def test_compiled_block_runs_fa4_kernels_and_matches_eager(tokens):
    assert activate_fa4(DEVICE)
    torch.manual_seed(0)
    proj = torch.nn.Linear(576, 3 * 576, device=DEVICE, dtype=torch.bfloat16)

    def block(x):
        b, n, c = x.shape
        q, k, v = proj(x).view(b, n, 3, 8, c // 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)

    x = torch.randn(4, tokens, 576, device=DEVICE, dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    with attention_context("flash_attn", DEVICE):
        eager_out = block(x)
        eager_out.float().square().mean().backward()
        eager_grad, proj.weight.grad = proj.weight.grad, None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = compiled(x)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
    kernels = " ".join(e.key for e in prof.key_averages())
    cudnn_forward = (
        torch.cuda.get_device_capability()[0] == 9 and tokens <= CUDNN_FORWARD_MAX_TOKENS
    )
    if cudnn_forward:
        assert "sdpa" in kernels.lower() and "flash_fwd_sm" not in kernels, kernels
    else:
        assert "flash_fwd_sm" in kernels, kernels
    assert "flash_bwd_sm" in kernels, kernels
    torch.testing.assert_close(out, eager_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(proj.weight.grad, eager_grad, rtol=2e-2, atol=2e-2)


class Attention(torch.nn.Module):
    """A DiT's attention at workload C's head dim (72)."""

    def __init__(self, hidden: int = 1152, heads: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, c))


def test_compiled_blocks_hand_fa4_the_packed_qkv_with_the_same_results():
    from litegen.compile import compile_blocks
    from litegen.kernels.packed_qkv import PACK_QKV
    from litegen.utils.config import CompileConfig

    assert activate_fa4(DEVICE)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(*(Attention() for _ in range(2))) for _ in range(2)]
    blocks[1].load_state_dict(blocks[0].state_dict())
    x = torch.randn(8, 256, 1152, device=DEVICE, dtype=torch.bfloat16)
    results = []
    for model, pack_qkv in zip(blocks, (False, True), strict=True):
        model.to(DEVICE, torch.bfloat16)
        torch._dynamo.reset()
        compile_blocks(model, CompileConfig(enabled=True), pack_qkv=pack_qkv)
        before = PACK_QKV.rewritten
        # Compiled, not loaded from the caches: the pass runs (and counts) only in a compile.
        no_caches = (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        )
        with attention_context("flash_attn", DEVICE), no_caches[0], no_caches[1]:
            out = model(x)
            out.float().square().mean().backward()
        results.append((out, [p.grad for p in model.parameters()], PACK_QKV.rewritten - before))
    (plain_out, plain_grads, plain_rewrites), (out, grads, rewrites) = results
    assert plain_rewrites == 0 and rewrites >= 1  # the blocks share one graph
    torch.testing.assert_close(out, plain_out, rtol=2e-2, atol=2e-2)
    for grad, expected in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-2)
