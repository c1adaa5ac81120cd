"""Sequence-parallel plans and shards in one process: lookup, checks, padding.

The collectives, the built-in plans (and their agreement with diffusers' own) at work on
several ranks are in tests/distributed/test_sequence_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litegen.parallel.sequence import SequencePlan, plan_for, register_sequence_plan
from litegen.parallel.sequence.comm import padded_length, shard
from litegen.parallel.sequence.sequence_plan import matching


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.inner = nn.Sequential(Attn())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 4)


PLAN = SequencePlan(
    split_inputs={"blocks.0": {"x": 1}},
    gather_outputs={"head": 1},
    attention={"blocks.*.attn": "self"},
)


def test_shard_pads_the_end_and_copies():
    x = torch.arange(10.0).view(1, 10)
    assert padded_length(10, 4) == 12 and padded_length(8, 4) == 8
    assert shard(x, 1, rank=0, n=4).tolist() == [[0.0, 1.0, 2.0]]
    assert shard(x, -1, rank=3, n=4).tolist() == [[9.0, 0.0, 0.0]]
    piece = shard(x, 1, rank=1, n=2)
    assert piece.tolist() == [[5.0, 6.0, 7.0, 8.0, 9.0]]
    assert piece.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_shard_backward_puts_the_gradient_in_its_slice():
    x = torch.ones(1, 5, requires_grad=True)
    shard(x, 1, rank=1, n=2).sum().backward()
    assert x.grad.tolist() == [[0.0, 0.0, 0.0, 1.0, 1.0]]


def test_wildcards_stand_for_one_path_component():
    assert list(matching(Net(), "blocks.*.attn")) == ["blocks.0.attn", "blocks.1.attn"]
    assert list(matching(Net(), "blocks.*.inner.*")) == ["blocks.0.inner.0", "blocks.1.inner.0"]


def test_a_model_without_plan_names_what_is_missing():
    with pytest.raises(ValueError) as err:
        plan_for(Net())
    message = str(err.value)
    assert "needs a sequence-parallel plan for Net" in message
    assert "WanTransformer3DModel" in message and "litegen_sp_plan = SequencePlan(" in message


def test_plans_come_from_the_registry_then_the_class_attribute():
    class Declared(Net):
        litegen_sp_plan = PLAN

    class ByMethod(Net):
        def litegen_sp_plan(self) -> SequencePlan:
            return PLAN

    assert plan_for(Declared()) is PLAN
    assert plan_for(ByMethod()) is PLAN
    other = SequencePlan(split_inputs={"blocks.1": {0: 1}}, gather_outputs={"head": 1})
    register_sequence_plan(Declared, other)
    assert plan_for(Declared()) is other


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (SequencePlan(gather_outputs={"head": 1}), "must split something"),
        (SequencePlan(split_inputs={"blocks.0": {"x": 1}}), "gather the output"),
        (
            SequencePlan(split_inputs={"blocks.9": {"x": 1}}, gather_outputs={"head": 1}),
            "names 'blocks.9' in split_inputs, which is not a module",
        ),
        (
            SequencePlan(
                split_inputs={"blocks.0": {"x": 1}},
                gather_outputs={"head": 1},
                attention={"blocks.*.attn": "cross"},
            ),
            "the layout 'cross'; use one of self, text_first, text_last",
        ),
        (
            SequencePlan(
                split_inputs={"blocks.0": {"x": 1}},
                gather_outputs={"head": 1},
                attention={"layers.*.attn": "self"},
            ),
            "'layers.*.attn' matches no module",
        ),
    ],
)
def test_plan_checks_name_the_problem(plan, message):
    with pytest.raises(ValueError, match=message):
        plan.check(Net())
