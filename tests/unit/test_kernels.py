"""apply_fused_layernorm: swap logic with a stand-in class, and the no-Apex path."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from litegen.kernels import apply_fused_layernorm, layernorm


class StandInFusedLayerNorm(nn.Module):
    """Same constructor and parameters as apex.normalization.FusedLayerNorm."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True):
        super().__init__()
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(8, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, elementwise_affine=False))
        self.norm_no_bias = nn.LayerNorm(8, bias=False)

    def forward(self, x):
        return self.norm_no_bias(self.mlp(self.norm1(x)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.ModuleList([Block()]), nn.LayerNorm((4, 8)))
    for p in model.parameters():  # non-trivial affine parameters
        p.data.normal_()
    model[0].norm1.bias.requires_grad_(False)
    return model


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model[2](model[1][0](model[0](x)))


def test_stand_in_swap_preserves_outputs_and_parameters():
    model = make_model()
    x = torch.randn(2, 4, 8)
    before = forward(model, x)
    old_norm = model[1][0].norm1
    assert apply_fused_layernorm(model, fused_cls=StandInFusedLayerNorm) == 5
    # Nested ones swapped (including inside ModuleList/Sequential); bias=False ones kept.
    new_norm = model[1][0].norm1
    assert isinstance(new_norm, StandInFusedLayerNorm)
    assert isinstance(model[0].mlp[1], StandInFusedLayerNorm)
    assert isinstance(model[2], StandInFusedLayerNorm)
    assert type(model[0].norm_no_bias) is nn.LayerNorm
    assert not any(type(m) is nn.LayerNorm and m.bias is not None for m in model.modules())
    assert new_norm.eps == 1e-6 and model[2].normalized_shape == (4, 8)
    assert model[0].mlp[1].weight is None and not model[0].mlp[1].elementwise_affine
    assert torch.equal(new_norm.weight, old_norm.weight)
    assert torch.equal(new_norm.bias, old_norm.bias)
    assert not model[0].norm1.bias.requires_grad and model[0].norm1.weight.requires_grad
    assert torch.allclose(forward(model, x), before, atol=1e-6)


def test_swap_keeps_dtype_and_shared_norms_shared():
    shared = nn.LayerNorm(8).to(torch.float64)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    assert apply_fused_layernorm(model, fused_cls=StandInFusedLayerNorm) == 1
    assert model["a"] is model["b"][0]
    assert model["a"].weight.dtype == torch.float64


def test_warns_once_and_returns_zero_without_apex(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)  # makes `import apex` raise ImportError
    monkeypatch.setattr(layernorm, "_warned_missing_apex", False)
    model = make_model()
    with pytest.warns(RuntimeWarning, match="Apex is not installed"):
        assert apply_fused_layernorm(model) == 0
    assert type(model[0].norm1) is nn.LayerNorm  # model untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert apply_fused_layernorm(model) == 0  # no second warning
