"""The attention backend setting: which context is entered, and that it changes no results."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from litegen.kernels import attention
from litegen.kernels.attention import FlashAttnMode, attention_context
from litegen.utils.config import KernelsConfig


def qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, 8, 16, generator=gen) for _ in range(3))


def test_math_backend_gives_the_default_outputs():
    q, k, v = qkv()
    default = F.scaled_dot_product_attention(q, k, v)
    with attention_context("math", "cpu"):
        chosen = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(chosen, default, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "backend"),
    [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)],
)
def test_a_named_backend_enters_sdpa_kernel_with_only_that_backend(name, backend):
    with mock.patch.object(attention, "sdpa_kernel", wraps=attention.sdpa_kernel) as spy:
        attention_context(name, "cuda")
    spy.assert_called_once_with([backend])


def test_auto_orders_backends_on_cuda_and_leaves_cpu_alone():
    with mock.patch.object(attention, "sdpa_kernel", wraps=attention.sdpa_kernel) as spy:
        assert attention_context("auto", "cpu").__class__.__name__ == "nullcontext"
        spy.assert_not_called()
        attention_context("auto", "cuda")
    if attention._HAS_PRIORITY:
        order = [attention.BACKENDS[n] for n in attention.AUTO_ORDER]
        spy.assert_called_once_with(order, set_priority=True)
        assert order[0] is SDPBackend.CUDNN_ATTENTION


def test_the_math_context_is_active_inside_and_restored_after():
    before = torch.backends.cuda.flash_sdp_enabled()
    with attention_context("math", "cpu"):
        assert torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() == before


def test_unknown_backend_and_missing_flash_attn_say_how_to_fix():
    with pytest.raises(ValueError, match="use one of"):
        attention_context("fastest", "cpu")
    with (
        mock.patch.object(attention.importlib, "import_module", side_effect=ImportError),
        pytest.raises(ValueError, match="flash-attn"),
    ):
        attention_context("flash_attn", "cuda")


def test_flash_attn_mode_routes_eligible_calls_with_the_right_layout():
    def fake_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        # FlashAttention's layout is (batch, tokens, heads, dim); compute it via torch's math.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        )
        return out.transpose(1, 2)

    q, k, v = (t.bfloat16() for t in qkv())  # FlashAttention takes fp16/bf16 only
    mode = FlashAttnMode(fake_flash, require_cuda=False)
    with mode:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8).bool())
    assert mode.calls == 1  # the masked call stayed with torch
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(masked, F.scaled_dot_product_attention(q, k, v))
    with FlashAttnMode(fake_flash) as cuda_only:  # CPU tensors never reach FlashAttention
        F.scaled_dot_product_attention(q, k, v)
    assert cuda_only.calls == 0


def test_config_accepts_the_backends_and_rejects_others():
    assert KernelsConfig().attention_backend == "auto"
    for name in attention.NAMES:
        assert KernelsConfig(attention_backend=name).attention_backend == name
    with pytest.raises(ValueError, match="attention_backend"):
        KernelsConfig(attention_backend="fastest")
