"""Compiled diffusers Wan blocks on CUDA: the gradients of the modulation table equal eager's.

A Wan block chunks one ``scale_shift_table + temb`` sum into six modulation slices; with
inductor's mix-order reduction on (torch 2.10 and later) the compiled backward leaves those
slices' gradients unwritten. LiteGen compiles with it off (``litegen/compile.py``).

    python3 -m pytest -q tests/gpu/test_compiled_modulation_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litegen.compile import compile_blocks
from litegen.utils.config import CompileConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DIM, HEADS, TOKENS, TEXT = 1536, 12, 7800, 512  # Wan 2.1 1.3B at 5 latent frames


def wan_blocks() -> nn.Module:
    transformer_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    torch.manual_seed(0)
    model = nn.Module()
    block = transformer_wan.WanTransformerBlock(
        DIM, 8960, HEADS, qk_norm="rms_norm_across_heads", cross_attn_norm=True, eps=1e-6
    )
    model.blocks = nn.ModuleList([block])
    return model.cuda()


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of the inputs and parameters of one block call, in FP32."""
    generator = torch.Generator("cuda").manual_seed(0)

    def randn(*shape: int, grad: bool = True) -> torch.Tensor:
        x = torch.randn(*shape, device="cuda", generator=generator)
        return x.requires_grad_(grad)

    hidden, text, temb = randn(1, TOKENS, DIM), randn(1, TEXT, DIM), randn(1, 6, DIM)
    rotary = (randn(1, TOKENS, 1, DIM // HEADS, grad=False),) * 2
    out = model.blocks[0](hidden, text, temb, rotary)
    out.backward(randn(*out.shape, grad=False))
    named = {"hidden": hidden, "text": text, "temb": temb} | dict(model.named_parameters())
    return {name: tensor.grad.clone() for name, tensor in named.items()}


def test_compiled_wan_block_gives_eager_gradients():
    model = wan_blocks()
    eager = gradients(model)
    model.zero_grad(set_to_none=True)
    compile_blocks(model, CompileConfig(enabled=True))
    compiled = gradients(model)
    for name in ("temb", "blocks.0.scale_shift_table", "hidden", "text"):
        error = (compiled[name] - eager[name]).norm() / eager[name].norm()
        assert error < 1e-3, f"{name}: relative error {error:.3g}"
