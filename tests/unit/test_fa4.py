"""FA4 behind torch's flash SDPA ops (litegen.kernels.fa4), on CPU with a stand-in for FA4.

The stand-in computes attention in FP32 with FA4's call signature and layout (batch, tokens,
heads, dim), and records what it was given. The checks run in a child process under Triton's
interpreter, which must be set before the kernel module is imported:

* outputs and gradients equal torch's math attention, from q, k, v that are views of one packed
  qkv tensor, as a DiT's attention makes them;
* every output has the strides of the aten ops' meta kernels, which compiled graphs assert;
* the backward pads q, k, v, out and dout with zeros to head dim 96 for head dim 72 (FA4's dq
  bug, see the module) and not at all for 64, where it hands FA4 the gradients to write into;
* ``copy_head_dim`` pads and slices any strides, with zeros past the source.

tests/gpu/test_fa4_gpu.py runs the real kernels.
"""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch
from torch.nn.attention import SDPBackend

from litegen.kernels import attention

pytest.importorskip("triton")

CHILD = r"""
import types
import torch
import torch.nn.functional as F
from litegen.kernels import fa4

seen = {}


def attend(q, k, v, scale):  # FA4's layout: (batch, tokens, heads, dim)
    scale = q.size(-1) ** -0.5 if scale is None else scale  # FA4's default
    scores = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) * scale
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v.float())
    return out, scores.logsumexp(-1)


def fwd(q, k, v, softmax_scale, causal, return_lse, out):
    assert return_lse and not causal
    seen["forward head dims"] = {t.size(-1) for t in (q, k, v, out)}
    result, lse = attend(q, k, v, softmax_scale)
    out.copy_(result)
    return out, lse, None, None, None


def bwd(q, k, v, out, dout, lse, softmax_scale, causal, deterministic, dq, dk, dv):
    seen["backward head dims"] = {t.size(-1) for t in (q, k, v, out, dout)}
    seen["preallocated"] = [t is not None for t in (dq, dk, dv)]
    seen["zero padding"] = all(bool((t[..., 72:] == 0).all()) for t in (q, k, v, out, dout))
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    attend(q, k, v, softmax_scale)[0].backward(dout.float())
    return tuple(t.grad for t in (q, k, v))


fa4.interface = lambda: types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)
flash = torch.ops.aten._scaled_dot_product_flash_attention.default
flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default


def on_meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def check(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(2, 24, 3, 4, head_dim, generator=gen).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (batch, heads, tokens, dim) views
    dout = torch.randn(2, 4, 24, head_dim, generator=gen)
    reference = F.scaled_dot_product_attention(q, k, v)
    reference.backward(dout)

    results = fa4.forward(q.detach(), k.detach(), v.detach())
    out, lse = results[:2]
    grads = fa4.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, None, None,
                         24, 24, 0.0, False, results[6], results[7])
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for grad, expected in zip(grads, qkv.grad.permute(2, 0, 3, 1, 4)):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)

    meta = flash(*(on_meta(t) for t in (q, k, v)))
    assert out.stride() == meta[0].stride() and lse.shape == meta[1].shape, (out.stride(), meta)
    assert lse.stride() == meta[1].stride() and lse.dtype == meta[1].dtype
    meta_grads = flash_backward(*(on_meta(t) for t in (dout, q, k, v, out, lse)), None, None,
                                24, 24, 0.0, False, *(on_meta(t) for t in results[6:8]))
    assert [g.stride() for g in grads] == [g.stride() for g in meta_grads]
    return seen.copy()


seen72 = check(72)
assert seen72["forward head dims"] == {72}, seen72
assert seen72["backward head dims"] == {96} and seen72["zero padding"], seen72
assert seen72["preallocated"] == [False] * 3, seen72
seen64 = check(64)
assert seen64["backward head dims"] == {64} and seen64["preallocated"] == [True] * 3, seen64

packed = torch.randn(2, 5, 3, 4, 72)
q = packed.unbind(2)[0]
padded = fa4.copy_head_dim(q, torch.full((2, 5, 4, 96), 7.0))
assert torch.equal(padded[..., :72], q) and bool((padded[..., 72:] == 0).all())
back = fa4.copy_head_dim(padded, torch.empty(2, 4, 5, 72).transpose(1, 2))
assert torch.equal(back, q)
try:
    fa4.forward(*packed.permute(2, 0, 3, 1, 4), dropout_p=0.1)
except RuntimeError as err:
    assert "dropout" in str(err)
else:
    raise AssertionError("dropout was accepted")
print("ok")
"""


def test_fa4_ops_match_math_attention_and_the_meta_layouts(triton_interpreter):
    assert triton_interpreter("-c", CHILD).strip().endswith("ok")


def test_flash_attn_puts_torchs_flash_backend_first_once_fa4_is_active():
    with (
        mock.patch.object(attention, "activate_fa4", return_value=True),
        mock.patch.object(attention, "sdpa_kernel", wraps=attention.sdpa_kernel) as spy,
    ):
        attention_context = attention.attention_context("flash_attn", "cuda")
    assert not isinstance(attention_context, attention.FlashAttnMode)
    expected = [attention.BACKENDS[n] for n in attention.FA4_ORDER]
    assert expected[0] is SDPBackend.FLASH_ATTENTION
    if attention._HAS_PRIORITY:
        spy.assert_called_once_with(expected, set_priority=True)


def test_fa4_stays_off_without_a_gpu_or_the_package():
    assert attention.activate_fa4("cpu") is False
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        assert attention.activate_fa4("cuda") is False
    from litegen.kernels import fa4

    fa4.interface.cache_clear()  # a real FA4 found earlier in this process would be cached
    with mock.patch.object(fa4.importlib, "import_module", side_effect=ImportError("no FA4")):
        assert fa4.register() is False
    with (
        mock.patch.object(fa4.importlib, "import_module", return_value=types.SimpleNamespace()),
        pytest.raises(ImportError, match="update flash-attn-4"),
    ):
        fa4.interface()
