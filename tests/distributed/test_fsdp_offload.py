"""FSDP2 with ``parallel.fsdp2.cpu_offload``: the same training as on the device, on 2 and 1
gloo ranks (on 1, without offload the model trains unwrapped), with every sharded parameter held
by the offload policy between steps; with ``selective_ratio: auto``, the same training as the
fixed plan the planner chose."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.models import PairDataset, loss_fn, make_model
from tests.distributed.runs import planned_and_fixed
from tests.distributed.test_fsdp import assert_same_weights, config_for, public, train

STEPS = 4


def first_grads(offload: bool, tmp: str) -> dict[str, torch.Tensor]:
    """Full gradients of one backward on the same batch on every rank."""
    from torch.distributed.tensor import DTensor

    import litegen

    gen = litegen.initialize(
        config_for("fsdp2", tmp, steps=1, parallel={"fsdp2": {"cpu_offload": offload}})
    )
    model = gen.prepare(make_model())
    batch = next(iter(torch.utils.data.DataLoader(PairDataset(8), batch_size=8)))
    loss_fn(model, batch).backward()
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def offload_suite(tmp: str) -> dict:
    out: dict = {}
    for offload in (False, True):
        fields = {"parallel": {"fsdp2": {"cpu_offload": offload}}}
        result = train("fsdp2", tmp, steps=STEPS, **fields)
        params = list(result["model"].parameters())
        states = [
            m._get_fsdp_state()._fsdp_param_group
            for m in result["model"].modules()
            if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group
        ]
        out[offload] = public(result) | {
            "offloaded": [fp.offload_to_cpu for g in states for fp in g.fsdp_params],
            "devices": sorted({_local(p).device.type for p in params}),
            "grads": first_grads(offload, tmp),
        }
    return out


@pytest.mark.parametrize("world_size", [2, 1])
def test_cpu_offload_trains_as_on_the_device(world_size, tmp_path):
    runs = run_ranks(offload_suite, world_size, str(tmp_path))[0]
    on_device, offloaded = runs[False], runs[True]
    assert offloaded["offloaded"] and all(offloaded["offloaded"])
    assert not any(on_device["offloaded"])
    assert offloaded["devices"] == ["cpu"]
    assert offloaded["losses"] == pytest.approx(on_device["losses"], rel=1e-5)
    assert_same_weights(offloaded["state"], on_device["state"], rtol=1e-5, atol=1e-6)
    assert_same_weights(offloaded["grads"], on_device["grads"], rtol=1e-5, atol=1e-7)


def offload_auto_suite(tmp: str) -> dict:
    """``selective_ratio: auto`` under cpu_offload, then the plan it chose fixed."""

    def run(checkpoint: dict) -> dict:
        fields = {"parallel": {"fsdp2": {"cpu_offload": True}}}
        result = train(
            "fsdp2", tmp, steps=3, memory={"activation_checkpoint": checkpoint}, **fields
        )
        memory = result["gen"].models[-1].memory
        plan = memory.planner.plan if memory.planner is not None else None
        return public(result) | {
            "memory": memory,
            "plan": plan,
            "checkpointed": memory.checkpointed,
        }

    planned, reference = planned_and_fixed(run)
    chosen = planned["checkpointed"]
    return {
        "chosen": chosen,
        "planned": list(planned["plan"].checkpointed),
        "described": planned["memory"].describe(),
        "fixed": reference["memory"].checkpointed,
        "losses": (planned["losses"], reference["losses"]),
        "state": (planned["state"], reference["state"]),
    }


@pytest.mark.parametrize("world_size", [2, 1])
def test_auto_checkpointing_under_cpu_offload_trains_as_its_fixed_plan(world_size, tmp_path):
    results = run_ranks(offload_auto_suite, world_size, str(tmp_path))
    runs = results[0]
    assert all(r["chosen"] == runs["chosen"] for r in results)  # every rank plans alike
    assert len(runs["chosen"]) == 1 and runs["planned"] == runs["chosen"] == runs["fixed"]
    assert ", ".join(runs["chosen"]) in runs["described"]
    planned, fixed = runs["losses"]
    assert planned == fixed
    assert_same_weights(*runs["state"], rtol=0, atol=0)
