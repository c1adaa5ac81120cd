"""Ring attention's CUDA kernels against ``F.scaled_dot_product_attention``: flash (bf16, no
mask) and memory-efficient (fp32, or a key mask), blocks merged by log-sum-exp, and the ring
function over a group of one rank with a padded chunk, text keys held whole and a key mask."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from litegen.parallel.sequence import torch_ring
from litegen.parallel.sequence.ring import Kernel, RingSpec, additive_mask, ring_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative to the largest value


@pytest.fixture(scope="module")
def group():
    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("nccl", rank=0, world_size=1)
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()


def close(value: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    error = (value.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error < TOLERANCE[dtype], f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_merged_by_log_sum_exp_equal_sdpa(dtype):
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, 600, 64, device="cuda", dtype=dtype) for _ in range(4))
    kernel = Kernel(q, masked=False)
    out = lse = None
    saved = []
    for kc, vc in zip(k.chunk(3, dim=2), v.chunk(3, dim=2), strict=True):
        block_out, block_lse, s = kernel.forward(q, kc, vc, None, None)
        saved.append(s)
        block_out, block_lse = block_out.float(), block_lse.float()
        out, lse = (
            (block_out, block_lse)
            if out is None
            else torch_ring.merge(out, lse, block_out, block_lse)
        )
    out = out.to(dtype)
    grads = [
        kernel.backward(dout, q, kc, vc, out, lse, None, None, s)
        for kc, vc, s in zip(k.chunk(3, dim=2), v.chunk(3, dim=2), saved, strict=True)
    ]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves)
    expected.backward(dout)
    close(out, expected, dtype, "out")
    close(sum(g[0].float() for g in grads), leaves[0].grad, dtype, "grad q")
    close(torch.cat([g[1] for g in grads], dim=2), leaves[1].grad, dtype, "grad k")
    close(torch.cat([g[2] for g in grads], dim=2), leaves[2].grad, dtype, "grad v")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_of_one_rank_with_padding_text_and_a_key_mask_equals_sdpa(group, dtype, masked):
    torch.manual_seed(1)
    length, chunk, text = 500, 504, 77  # the chunk carries 4 tokens of padding
    q, k, v, dout = (
        torch.randn(2, 4, length + text, 64, device="cuda", dtype=dtype) for _ in range(4)
    )
    keep = torch.ones(2, 1, 1, length + text, dtype=torch.bool, device="cuda")
    keep[1, ..., -20:] = False  # padding of the second sample's text
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=keep if masked else None)
    expected.backward(dout)

    pad = (0, 0, 0, chunk - length)
    video = [F.pad(t[:, :, :length], pad).requires_grad_() for t in (q, k, v)]
    texts = [t[:, :, length:].clone().requires_grad_() for t in (q, k, v)]
    mask = additive_mask(keep, dtype) if masked else None
    spec = RingSpec(
        group,
        lengths=(length,),
        chunk_masks=(mask[..., :length],) if masked else None,
        local_mask=mask[..., length:] if masked else None,
    )
    query = torch.cat([video[0], texts[0]], dim=2)
    out = ring_attention(query, video[1], video[2], spec, texts[1], texts[2])
    grad = torch.cat([F.pad(dout[:, :, :length], pad), dout[:, :, length:]], dim=2)
    out.backward(grad)
    close(out[:, :, :length], expected[:, :, :length], dtype, "out video")
    close(out[:, :, chunk:], expected[:, :, length:], dtype, "out text")
    for name, part, whole in zip("qkv", video, leaves, strict=True):
        close(part.grad[:, :, :length], whole.grad[:, :, :length], dtype, f"grad {name}")
    for name, part, whole in zip("qkv", texts, leaves, strict=True):
        close(part.grad, whole.grad[:, :, length:], dtype, f"grad text {name}")
