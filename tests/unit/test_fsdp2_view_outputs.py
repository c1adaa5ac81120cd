"""fsdp2 on one gloo rank, wrapped (a world of one otherwise trains unwrapped): a unit whose
output is a view (as diffusers' models return) trains without torch's per-rank "returned a view
tensor" warning, and with the same gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import litegen
from litegen.parallel.fsdp2 import Fsdp2Strategy
from litegen.utils.config import MainConfig


@pytest.fixture(autouse=True)
def _own_process_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[:, 1:]  # a slice, as a single-stream block's image part


class Unpatchify(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(torch.cat([x[:, :1], x], dim=1))
        return x.reshape(x.shape[0], -1)  # a view, as unpatchify's reshape


def test_view_outputs_train_under_fsdp2_without_the_view_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(Fsdp2Strategy, "unwrap_single_rank", False)
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path),
            "optimization": {"parallel": {"strategy": "fsdp2"}},
        }
    )
    gen = litegen.initialize(config)
    torch.manual_seed(0)
    reference = Unpatchify()
    model = Unpatchify()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, the ones shown once per rank too
        model = gen.prepare(model)
        model(x).square().mean().backward()
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]
    reference(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
