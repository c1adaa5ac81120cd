"""FP8 storage of frozen Linear weights: the round trip within E4M3's bounds, the layer equal
to an nn.Linear holding the dequantised weight (outputs and input gradients), and what a LoRA
model's layers become."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litegen.config import LoRAConfig
from litegen.lora import apply_lora
from litegen.precision.fp8_weights import (
    FP8Linear,
    dequantize,
    quantize,
    store_frozen_linears_in_fp8,
)
from tests.distributed.models import make_model


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_round_trip_is_within_e4m3_bounds(scaling):
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitude: rowwise scales keep the small rows' precision.
    weight = torch.randn(16, 64, generator=gen) * torch.logspace(-5, 1, 16).unsqueeze(1)
    fp8, scale = quantize(weight, scaling)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.element_size() == 1
    assert scale.shape == ((16, 1) if scaling == "rowwise" else ())
    back = dequantize(fp8, scale, torch.float32)
    # 3 mantissa bits: half an ulp is 2^-4 relative; below the normal range, 2^-10 of the scale.
    bound = weight.abs() * 2**-4 + scale * 2**-10
    assert ((back - weight).abs() <= bound).all()
    rowwise_error = (dequantize(*quantize(weight, "rowwise"), torch.float32) - weight).abs()
    tensorwise_error = (dequantize(*quantize(weight, "tensorwise"), torch.float32) - weight).abs()
    assert rowwise_error[0].max() < tensorwise_error[0].max()  # the smallest row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_equals_a_linear_with_the_dequantised_weight(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(32, 16).to(dtype).requires_grad_(False)
    layer = FP8Linear.from_linear(linear, "rowwise")
    reference = nn.Linear(32, 16).to(dtype).requires_grad_(False)
    reference.weight.copy_(layer.dequantized())
    reference.bias.copy_(linear.bias)
    x = torch.randn(4, 32, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, out_ref = layer(x), reference(x_ref)
    torch.testing.assert_close(out, out_ref)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert layer.weight.grad is None and not layer.weight.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(layer(x), out_ref)


def test_a_lora_models_frozen_linears_become_fp8_and_the_adapters_train():
    model = make_model()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=["mlp.0", "mlp.2", "ada"]))
    replaced = store_frozen_linears_in_fp8(model, "tensorwise")
    assert "blocks.0.mlp.0.base_layer" in replaced and "embed" in replaced
    assert not [p for p in replaced if "lora_" in p]  # adapters keep their dtype
    base = model.blocks[0].mlp[0].base_layer
    assert base.fp8.dtype == torch.float8_e4m3fn and base.weight_fp8.dtype == torch.int8
    assert base.weight.dtype == torch.float32  # what models that probe their dtype read
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = torch.randn(8, 4, 8)
    losses = []
    for _ in range(5):
        loss = model(data).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_the_docs_large_base_config_loads():
    import yaml

    from litegen.config import MainConfig
    from tests.unit.test_doc_snippets import blocks

    text = blocks("lora.md", "## Large bases: FP8 weights and block swap", "yaml")[0]
    optimization = MainConfig.from_dict(yaml.safe_load(text)).optimization
    assert optimization.lora.fp8_base == "rowwise"
    assert optimization.memory.block_swap.blocks_on_device == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_diffusers_wan_with_an_fp8_base_computes_what_its_dequantised_base_does(dtype):
    """Wan's time embedder casts its input to its first parameter's dtype: the FP8 bits must not
    be taken for it, and each layer's input must meet its weight's dtype (no autocast here)."""
    from litegen_zoo.real_models import REAL_MODELS

    spec = REAL_MODELS["wan"]
    lora = LoRAConfig(rank=4, alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    stored = apply_lora(spec.build("tiny", seed=0), lora).to(dtype)
    replaced = store_frozen_linears_in_fp8(stored, "rowwise")
    assert "condition_embedder.time_embedder.linear_1" in replaced
    reference = apply_lora(spec.build("tiny", seed=0), lora).to(dtype)
    with torch.no_grad():  # the same function: each frozen weight set to its dequantised value
        for path in replaced:
            reference.get_submodule(path).weight.copy_(stored.get_submodule(path).dequantized())
    batch = spec.batch("tiny", batch_size=2, seed=0)
    losses = [spec.loss(model, batch) for model in (stored, reference)]
    torch.testing.assert_close(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    grads = [
        [p.grad for n, p in model.named_parameters() if "lora_" in n]
        for model in (stored, reference)
    ]
    assert all(g is not None for g in grads[0])
    torch.testing.assert_close(grads[0], grads[1])
