"""FA4 behind torch's flash SDPA ops (litegen.kernels.fa4), on CPU with a stand-in for FA4.

The stand-in computes attention in FP32 with FA4's call signature and layout (batch, tokens,
heads, dim), and records what it was given:

* outputs and gradients equal torch's math attention, from q, k, v that are views of one packed
  qkv tensor, as a DiT's attention makes them, at head dims 72 and 64, with FA4 writing the
  gradients into tensors LiteGen allocates;
* every output has the strides of the aten ops' meta kernels, which compiled graphs assert;
* the dq fix hands FA4's postprocess its Hopper kernel's head-dim rounding (16, not 32), and
  nothing else changes;
* on Hopper, cuDNN takes the forward of sequences up to 1024 tokens (the rule; its kernels run in
  tests/gpu), and otherwise the forward asks for 128 x 128 tiles only where FA4's Hopper default
  pads short sequences;
* only the tested FA4 release is accepted.

tests/gpu/test_fa4_gpu.py runs the real kernels.
"""

from __future__ import annotations

import importlib.metadata
import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from litegen.kernels import attention, fa4

FLASH = torch.ops.aten._scaled_dot_product_flash_attention.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default


class StandInFA4:
    """FA4's two private functions, in FP32, recording the calls."""

    def __init__(self):
        self.seen = {}

    @staticmethod
    def _get_device_arch():
        return 80  # not Hopper, so LiteGen keeps FA4's forward tiles

    @staticmethod
    def attend(q, k, v, scale):  # FA4's layout: (batch, tokens, heads, dim)
        scale = q.size(-1) ** -0.5 if scale is None else scale  # FA4's default
        scores = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) * scale
        out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v.float())
        return out, scores.logsumexp(-1)

    def _flash_attn_fwd(self, q, k, v, softmax_scale, causal, return_lse, out, tile_mn):
        assert return_lse and not causal and tile_mn is None  # FA4's own tiles off Hopper
        result, lse = self.attend(q, k, v, softmax_scale)
        out.copy_(result)
        return out, lse, None, None, None

    def _flash_attn_bwd(
        self, q, k, v, out, dout, lse, softmax_scale, causal, deterministic, dq, dk, dv
    ):
        self.seen["head dims"] = {t.size(-1) for t in (q, k, v, out, dout)}
        # By formula, not autograd: LiteGen's packed op calls this below autograd's dispatch.
        scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
        q, k, v, dout = (t.float() for t in (q, k, v, dout))
        probs = (torch.einsum("bshd,bthd->bhst", q, k) * scale).softmax(-1)
        grad_probs = torch.einsum("bshd,bthd->bhst", dout, v)
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True)) * scale
        dq.copy_(torch.einsum("bhst,bthd->bshd", grad_scores, k))
        dk.copy_(torch.einsum("bhst,bshd->bthd", grad_scores, q))
        dv.copy_(torch.einsum("bhst,bshd->bthd", probs, dout))
        return dq, dk, dv


def on_meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("head_dim", [72, 64])
def test_fa4_ops_match_math_attention_and_the_meta_layouts(head_dim):
    stand_in = StandInFA4()
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(2, 24, 3, 4, head_dim, generator=gen).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (batch, heads, tokens, dim) views
    dout = torch.randn(2, 4, 24, head_dim, generator=gen)
    reference = F.scaled_dot_product_attention(q, k, v)
    reference.backward(dout)

    with mock.patch.object(fa4, "interface", return_value=stand_in):
        results = fa4.forward(q.detach(), k.detach(), v.detach())
        out, lse = results[:2]
        grads = fa4.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, None, None,
                             24, 24, 0.0, False, results[6], results[7])  # fmt: skip
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for grad, expected in zip(grads, qkv.grad.permute(2, 0, 3, 1, 4), strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)
    assert stand_in.seen["head dims"] == {head_dim}  # no padding

    meta = FLASH(*(on_meta(t) for t in (q, k, v)))
    assert out.stride() == meta[0].stride() and lse.shape == meta[1].shape
    assert lse.stride() == meta[1].stride() and lse.dtype == meta[1].dtype
    meta_grads = FLASH_BACKWARD(*(on_meta(t) for t in (dout, q, k, v, out, lse)), None, None,
                                24, 24, 0.0, False, *(on_meta(t) for t in results[6:8]))  # fmt: skip
    assert [g.stride() for g in grads] == [g.stride() for g in meta_grads]


@pytest.mark.parametrize(
    ("batch_heads_tokens_dim", "is_causal", "major", "expected"),
    [
        ((128, 16, 256, 72), False, 9, (128, 128)),  # workload C: FA4's 192 x 144 pads 1.7x
        ((8, 16, 4096, 72), False, 9, None),  # workload A: FA4's tiles pad 5%
        ((128, 16, 256, 72), True, 9, None),  # FA4 tunes causal tiles itself
        ((128, 16, 256, 64), False, 9, None),  # other head dims have other default tiles
        ((128, 16, 256, 128), False, 9, None),
        ((128, 16, 256, 72), False, 10, None),  # Blackwell
    ],
)
def test_forward_tiles_shrink_only_where_fa4s_hopper_tiles_pad_a_lot(
    batch_heads_tokens_dim, is_causal, major, expected
):
    query = torch.empty(batch_heads_tokens_dim, device="meta")
    assert fa4._forward_tile(query, query, is_causal, major * 10) == expected


@pytest.mark.parametrize(
    ("batch_heads_tokens_dim", "is_causal", "major", "cudnn_on", "expected"),
    [
        ((128, 16, 256, 72), False, 9, True, True),  # workload C
        ((32, 16, 1024, 72), False, 9, True, True),
        ((16, 16, 2048, 72), False, 9, True, False),  # FA4's forward is faster from 2048 on
        ((128, 12, 256, 128), False, 9, True, True),
        ((128, 4, 256, 256), False, 9, True, False),  # past the head dims measured
        ((128, 16, 256, 72), True, 9, True, False),  # causal: not measured
        ((128, 16, 256, 72), False, 10, True, False),  # Blackwell
        ((128, 16, 256, 72), False, 9, False, False),  # torch.backends.cudnn.enabled = False
    ],
)
def test_short_sequences_take_cudnns_forward_on_hopper(
    batch_heads_tokens_dim, is_causal, major, cudnn_on, expected
):
    query = torch.empty(batch_heads_tokens_dim, device="meta")
    with (
        mock.patch("torch.backends.cudnn.is_available", return_value=True),
        torch.backends.cudnn.flags(enabled=cudnn_on),
    ):
        assert fa4._forward_on_cudnn(query, query, is_causal, major * 10) == expected


def test_a_long_key_sequence_keeps_fa4s_forward():
    query, key = (
        torch.empty(1, 4, 256, 72, device="meta"),
        torch.empty(1, 4, 4096, 72, device="meta"),
    )
    with mock.patch("torch.backends.cudnn.is_available", return_value=True):
        assert not fa4._forward_on_cudnn(query, key, False, 90)


def test_fa4_refuses_dropout():
    q, k, v = torch.randn(3, 2, 4, 5, 72).unbind(0)
    with pytest.raises(RuntimeError, match="dropout"):
        fa4.forward(q, k, v, dropout_p=0.1)


def fake_fa4_module(arch: int) -> types.SimpleNamespace:
    """FA4's interface module as far as the dq fix sees it; calls record hdim_multiple_of."""
    calls = []

    def preprocess(out, dout, *, hdim_multiple_of=32, fake_mode):
        calls.append(("pre", hdim_multiple_of))

    def postprocess(accum, output, *, hdim_multiple_of=32, fake_mode):
        calls.append(("post", hdim_multiple_of))

    postprocess.compile_cache = {"post": "kernel"}
    return types.SimpleNamespace(
        _get_device_arch=lambda: arch,
        _bwd_preprocess=preprocess,
        _bwd_postprocess_convert=postprocess,
        calls=calls,
    )


@pytest.mark.parametrize(
    ("arch", "passed", "expected"),
    [(90, 32, 16), (90, 64, 64), (100, 32, 32)],
)
def test_dq_fix_gives_hoppers_postprocess_the_kernels_rounding(arch, passed, expected):
    module = fake_fa4_module(arch)
    fa4._match_dq_accumulator_to_kernel(module)
    fa4._match_dq_accumulator_to_kernel(module)  # a second load must not wrap twice
    module._bwd_preprocess(1, 2, hdim_multiple_of=passed, fake_mode=False)
    module._bwd_postprocess_convert(1, 2, hdim_multiple_of=passed, fake_mode=False)
    # The preprocess only zeroes the accumulator, in a buffer sized for FA4's own rounding.
    assert module.calls == [("pre", passed), ("post", expected)]
    assert module._bwd_postprocess_convert.compile_cache == {"post": "kernel"}  # looked up by name


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
    fa4.interface.cache_clear()  # a real FA4 found earlier in this process would be cached
    missing = importlib.metadata.PackageNotFoundError("flash-attn-4")
    with mock.patch.object(importlib.metadata, "version", side_effect=missing):
        assert fa4.register() is False


def test_fa4_accepts_only_the_tested_release():
    fa4.interface.cache_clear()
    with (
        mock.patch.object(importlib.metadata, "version", return_value="4.0.0b99"),
        pytest.raises(ImportError, match=r"flash-attn-4==4\.0\.0b36 and found 4\.0\.0b99"),
    ):
        fa4.interface()
    fa4.interface.cache_clear()
    with (
        mock.patch.object(importlib.metadata, "version", return_value=fa4.FA4_VERSION),
        mock.patch.object(fa4.importlib, "import_module", return_value=types.SimpleNamespace()),
        pytest.raises(ImportError, match="_flash_attn_fwd"),
    ):
        fa4.interface()
    fa4.interface.cache_clear()
