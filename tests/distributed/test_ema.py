"""Sharded EMA: equal to an unsharded reference for every strategy, 1/dp of the memory,
and saved/loaded (also at another world size) without drift."""

import pytest
import torch

from litegen.config.strategies import names_where
from tests.distributed.harness import run_ranks
from tests.distributed.models import PairDataset, loss_fn, make_model

pytestmark = pytest.mark.slow

DECAY = 0.9
STEPS = 20


def make(strategy: str, extra: dict | None = None):
    import litegen
    from litegen.utils.config import MainConfig

    fields = {
        "runtime": {"device": "cpu"},
        "global_batch_size": 8,
        "max_steps": STEPS,
        "ema": {"enable": True, "decay": DECAY},
        "optimization": {"parallel": {"strategy": strategy}},
        **(extra or {}),
    }
    gen = litegen.initialize(MainConfig.from_dict(fields))
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(40))
    return gen, model, optimizer, loader


def masters_or_weights(gen, model, optimizer) -> dict[str, torch.Tensor]:
    """The full trajectory point the EMA should follow: master weights when they exist."""
    entry = gen.models[0]
    weights = entry.strategy.full_model_state(model)
    optim = entry.strategy.full_optimizer_state(optimizer, model)
    for name, state in optim.get("state", {}).items():
        if isinstance(state, dict) and "master" in state:
            weights[name] = state["master"]
    return {k: v.float().clone() for k, v in weights.items()}


def train_with_reference(strategy: str, extra: dict | None = None) -> dict:
    gen, model, optimizer, loader = make(strategy, extra)
    reference = masters_or_weights(gen, model, optimizer)  # TinyDiT has no buffers
    for batch in loader:
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        gen.update_ema()
        point = masters_or_weights(gen, model, optimizer)
        for n in reference:
            reference[n].lerp_(point[n], 1 - DECAY)
    ema = gen.full_ema_state()
    assert set(ema) == set(reference), (sorted(ema)[:3], sorted(reference)[:3])
    n_params = sum(p.numel() for p in reference.values())
    entry = gen.models[0]
    optim = entry.strategy.full_optimizer_state(optimizer, model)
    return {
        "masters": sum("master" in state for state in optim.get("state", {}).values()),
        "ema": ema,
        "reference": reference,
        "local_bytes": gen.ema.local_bytes(),
        "full_bytes": 4 * n_params,
    }


# Every strategy of the table that runs on one node; those needing more: the test below.
STRATEGIES = names_where(lambda row: row.min_nodes == 1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gathered_ema_equals_the_unsharded_reference(strategy):
    results = run_ranks(train_with_reference, 2, strategy)
    for result in results:
        for name, value in result["reference"].items():
            torch.testing.assert_close(result["ema"][name], value, rtol=1e-6, atol=1e-7)
    # Each rank holds about half of the FP32 average (dim-0 chunks round up per tensor).
    local = results[0]["local_bytes"]
    assert local <= 0.6 * results[0]["full_bytes"], (local, results[0]["full_bytes"])


def test_hsdp_ema_on_two_simulated_nodes():
    results = run_ranks(train_with_reference, 4, "hsdp", local_world_size=2)
    for name, value in results[0]["reference"].items():
        torch.testing.assert_close(results[0]["ema"][name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp2"])
def test_ema_follows_fp32_master_weights(strategy):
    extra = {
        "optimization": {
            "parallel": {"strategy": strategy},
            "precision": {"cast_model": "bf16"},
            "optimizer": {"fp32_master_weights": True},
        }
    }
    (result, _) = run_ranks(train_with_reference, 2, strategy, extra)
    assert result["masters"] == len(result["reference"])  # every parameter has one
    for name, value in result["reference"].items():
        torch.testing.assert_close(result["ema"][name], value, rtol=1e-6, atol=1e-7)


def test_unsharded_ema_keeps_a_full_replica():
    (result, _) = run_ranks(
        train_with_reference, 2, "ddp", {"ema": {"enable": True, "decay": DECAY, "sharded": False}}
    )
    assert result["local_bytes"] == result["full_bytes"]
    for name, value in result["reference"].items():
        torch.testing.assert_close(result["ema"][name], value, rtol=1e-6, atol=1e-7)


def save_then_continue(strategy: str, folder: str, phase: str) -> dict:
    """Phase 'save': 5 steps, then DCP save + full file. Phase 'load': load, 5 more updates."""
    gen, model, optimizer, loader = make(strategy, {"max_steps": 10})
    batches = iter(loader)
    if phase == "load":
        gen.load_model_state(folder, model=model, optimizer=optimizer, ema=True)
        loaded = gen.full_ema_state()
        for _ in range(5):
            next(batches)  # the same data the saving run saw, so trajectories agree
    for _, batch in zip(range(5), batches, strict=False):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        gen.update_ema()
    if phase == "save":
        gen.save_model_state(folder, model=model, optimizer=optimizer, ema=True)
        gen.save_ema(output_folder=folder + "_full")
        return {"ema": gen.full_ema_state()}
    return {"loaded": loaded, "ema": gen.full_ema_state()}


@pytest.mark.parametrize(("strategy", "save_ranks", "load_ranks"), [("fsdp2", 4, 2), ("ddp", 2, 4)])
def test_ema_reshards_through_dcp_and_keeps_updating(tmp_path, strategy, save_ranks, load_ranks):
    folder = str(tmp_path / "ckpt")
    saved = run_ranks(save_then_continue, save_ranks, strategy, folder, "save")[0]["ema"]
    straight = run_ranks(save_then_continue, 1, strategy, str(tmp_path / "other"), "save")
    resumed = run_ranks(save_then_continue, load_ranks, strategy, folder, "load")[0]
    for name, value in saved.items():
        torch.testing.assert_close(resumed["loaded"][name], value)
    full_file = torch.load(tmp_path / "ckpt_full" / "default_exp.ema.pth", weights_only=True)
    for name, value in saved.items():
        torch.testing.assert_close(full_file[name], value)
    assert set(resumed["ema"]) == set(straight[0]["ema"])
