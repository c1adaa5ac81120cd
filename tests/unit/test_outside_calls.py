"""Which submodules of sharding units a model's code calls from outside their unit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litegen.model_parts.blocks import repeated_blocks
from litegen.parallel.outside_calls import called_from_outside
from litegen_zoo.real_models import REAL_MODELS
from tests.distributed.models import TinyDiT


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Sequential(nn.Linear(4, 4), nn.SiLU(), nn.Linear(4, 4))
        self.act = nn.SiLU()  # no parameters: harmless wherever it runs
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.emb(x)


class Model(nn.Module):
    """Runs its blocks, then ``tail``: each subclass reaches into the blocks its own way."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.heads = nn.ModuleDict({"out": nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)  # a unit called as a whole: fine
        return self.tail(self.heads["out"](x))

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0].act(x)  # no parameters: fine


class Chain(Model):
    def tail(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.blocks[0].emb(x)


class Bound(Model):
    def tail(self, x: torch.Tensor) -> torch.Tensor:
        emb = self.blocks[1].emb
        return x + emb(x)


class Loop(Model):
    def tail(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = x + block.proj(x) * i
        return x


class Helper(Model):
    def tail(self, x: torch.Tensor) -> torch.Tensor:
        return self._last_embedding(x)

    def _last_embedding(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[-1].emb[0](x)


UNITS = ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize(
    ("model_class", "expected"),
    [
        (Chain, ["blocks.0.emb"]),
        (Bound, ["blocks.1.emb"]),
        (Loop, ["blocks.0.proj", "blocks.1.proj", "blocks.2.proj"]),
        (Helper, ["blocks.2.emb.0"]),  # through a second method, with a negative index
        (Model, []),  # blocks.0.act has no parameters
    ],
)
def test_calls_into_a_unit_from_outside_are_found(model_class, expected):
    assert called_from_outside(model_class(), UNITS) == expected


def test_excluded_modules_are_never_units():
    assert called_from_outside(Chain(), UNITS, excluded=["blocks.0.emb"]) == []


def test_a_unit_calling_into_a_unit_nested_in_it_is_found():
    # Once blocks.0.emb is a unit, Block.forward's call of self.emb is still fine (a whole
    # unit), but a call of one of its layers from block 0's code would not be.
    class Reaching(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.emb(x) + self.emb[2](x)

    model = Model()
    model.blocks[0] = Reaching()
    assert called_from_outside(model, ["blocks.0.emb", *UNITS]) == ["blocks.0.emb.2"]
    # Without the nested unit, block 0's own code calling its own layers is fine.
    assert called_from_outside(model, UNITS) == []


def test_models_that_stay_inside_their_units_get_nothing():
    model = TinyDiT()
    assert called_from_outside(model, repeated_blocks(model)) == []


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_models(name):
    """diffusers' DiT runs block 0's embedding after the blocks; the others call no such thing."""
    model = REAL_MODELS[name].build("tiny")
    expected = ["transformer_blocks.0.norm1.emb"] if name == "dit" else []
    assert called_from_outside(model, repeated_blocks(model)) == expected
