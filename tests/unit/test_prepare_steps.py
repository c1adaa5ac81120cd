"""The steps a model takes in ``prepare`` are one list (``litegen.runtime.steps.MODEL_STEPS``):
docs/architecture.md names them in its order, ``prepare`` runs the ones that apply in that
order, and the peak estimate runs the ones that change what a model stores."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn

import litegen
from litegen.config import OptimizationConfig
from litegen.runtime.steps import ESTIMATE_STEPS, MODEL_STEPS, apply_estimate_steps
from litegen.utils.config import MainConfig

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## What `prepare` does to a model, in order"


def documented_steps() -> list[tuple[str, bool]]:
    """``(name, every model)`` of each numbered step in docs/architecture.md's section."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^\d+\. `(\w+)`( \(every model\))?", section, flags=re.MULTILINE)
    return [(name, bool(every)) for name, every in found]


def test_the_architecture_doc_lists_the_steps_in_their_order():
    assert documented_steps() == [(s.name, not s.trained_only) for s in MODEL_STEPS]


def test_the_estimate_takes_the_steps_that_change_stored_weights_from_the_list():
    assert [s.name for s in ESTIMATE_STEPS] == ["cast_model", "fp8_base"]
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = OptimizationConfig(
        precision={"cast_model": "bf16", "cast_exclude_paths": ["1"]},
        kernels={"fused_layernorm": True},  # a module swap: not the estimate's business
    )
    prepared = apply_estimate_steps(net, None, opt)
    assert prepared[0].weight.dtype == torch.bfloat16 and prepared[1].weight.dtype == torch.float32
    assert type(prepared[1]) is nn.LayerNorm


def ran_steps(caplog, *objects, **fields):
    config = MainConfig.from_dict({"runtime": {"device": "cpu"}, **fields})
    gen = litegen.initialize(config)
    with caplog.at_level(logging.DEBUG, logger="litegen"):
        gen.prepare(*objects)
    ran: dict[str, list[str]] = {}
    for record in caplog.records:
        model, _, step = record.getMessage().partition(": prepare step ")
        if step:
            ran.setdefault(model, []).append(step)
    return gen, ran


class Trained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Frozen(nn.Linear):
    pass


def test_prepare_runs_the_steps_that_apply_in_the_list_order(caplog):
    model, vae = Trained(), Frozen(4, 4).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen, ran = ran_steps(
        caplog,
        model,
        optimizer,
        vae,
        optimization={
            "precision": {"cast_model": "bf16"},
            "memory": {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.0}},
        },
    )
    assert ran == {
        "Trained": ["cast_model", "memory_savers", "wrap"],
        "Frozen": ["cast_model", "wrap"],
    }
    assert gen.models[0].memory.checkpointed == ["blocks.0", "blocks.1"]
    assert model.blocks[0][0].weight.dtype == vae.weight.dtype == torch.bfloat16
    assert not vae.training and not gen.models[1].trainable


def test_the_parallel_plan_is_built_once_per_job(caplog, monkeypatch):
    from litegen.parallel import ParallelPlan

    built = []
    build = ParallelPlan.build.__func__

    def counted(cls, *args, **kwargs):
        built.append(args[0])
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(ParallelPlan, "build", classmethod(counted))
    gen, _ = ran_steps(caplog, nn.Linear(4, 4))
    gen.prepare(nn.Linear(4, 4))
    assert built == ["ddp"]


def test_fsdp2_plans_a_models_units_once_for_checkpointing_and_the_wrap(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from litegen.parallel import fsdp2

    planned = []

    def counted(model, cfg):
        planned.append(type(model).__name__)
        return select_wrap_units(model, cfg)

    select_wrap_units = fsdp2.select_wrap_units
    monkeypatch.setattr(fsdp2, "select_wrap_units", counted)
    monkeypatch.setattr(fsdp2.Fsdp2Strategy, "unwrap_single_rank", False)
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "optimization": {
                "parallel": {"strategy": "fsdp2"},
                "memory": {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.0}},
            },
        }
    )
    gen = litegen.initialize(config)
    try:
        model = gen.prepare(Trained())
        assert planned == ["Trained"]
        assert gen.models[0].memory.checkpointed == ["blocks.0", "blocks.1"]
        assert all(isinstance(block, FSDPModule) for block in model.blocks)
    finally:
        torch.distributed.destroy_process_group()
