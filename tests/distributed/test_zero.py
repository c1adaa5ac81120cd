"""ZeRO-1 / ZeRO-2 on 2 and 4 gloo CPU ranks: equal to DDP, checkpoints, master weights, memory.

Starting ranks is the slow part, so each world size runs once (a module fixture) and does
every training run in one process group; the tests then check pieces of what came back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.models import PairDataset, loss_fn, make_model

pytestmark = pytest.mark.slow

STEPS = 20
# bucket_size_mb is whole megabytes; the test model is ~40 kB, so the tests shrink a "MB" to
# 8 kB to get several buckets (and so exercise ordering, hooks and partitions across them).
TEST_BYTES_PER_MB = 8 << 10

ZERO_VARIANTS = {
    "zero1_bucketed": {"strategy": "zero1"},
    "zero1_bucketed_no_overlap": {"strategy": "zero1", "zero": {"overlap_comm": False}},
    "zero1_flat_layout_keep_buffers": {
        "strategy": "zero1",
        "zero": {"normalize_parameter_layout": True, "release_grad_buffer": False},
    },
    "zero1_native": {"strategy": "zero1", "zero": {"parameter_sync": "native"}},
    "zero1_native_bucket_view": {
        "strategy": "zero1",
        "zero": {"parameter_sync": "native_bucket_view"},
    },
    "zero2": {"strategy": "zero2"},
    "zero2_no_overlap": {"strategy": "zero2", "zero": {"overlap_comm": False}},
}


def config(tmp: str, parallel: dict, accum: int = 1, precision: dict | None = None, **optim):
    from litegen.utils.config import MainConfig

    return MainConfig.from_dict(
        {
            "exp_name": "zero",
            "results_dir": tmp,
            "runtime": {"device": "cpu", "distributed": {"dist_timeout": 120}},
            "global_batch_size": 8,
            "max_steps": STEPS,
            "global_seed": 3,
            "trainer": {
                "grad_accum_steps": accum,
                "log_every": 1,
                "save_final": False,
                "max_grad_norm": 0.5,  # small enough that clipping is active
            },
            "optimization": {
                "parallel": parallel,
                "precision": precision or {},
                "optimizer": optim,
            },
        }
    )


def train_step(batch, model):
    return loss_fn(model, batch)


def train(tmp: str, parallel: dict, accum: int = 1, steps: int = STEPS, **kwargs):
    """One run through Trainer; returns (gen, model, optimizer, losses)."""
    import litegen
    from litegen.parallel import zero1
    from litegen.trainer import Trainer

    zero1.BYTES_PER_MB = TEST_BYTES_PER_MB
    cfg = config(tmp, parallel, accum, **kwargs)
    cfg = cfg.model_copy(update={"max_steps": steps})
    gen = litegen.initialize(cfg)
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(64))
    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    losses = Trainer(gen, train_step, parts).fit()
    return gen, model, optimizer, losses


def weights(gen, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in gen.unwrap(model).state_dict().items()}


def state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    return sum(
        v.numel() * v.element_size()
        for s in inner.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )


def full_optim(gen, model, optimizer):
    entry = gen._entry(model)
    return entry.strategy.full_optimizer_state(optimizer, model)


# -- rank functions ------------------------------------------------------------------------------
def equivalence_rank(tmp: str) -> dict:
    out: dict = {"runs": {}, "state_bytes": {}}
    for accum in (1, 2):
        variants = {"ddp": {"strategy": "ddp"}, **ZERO_VARIANTS}
        for name, parallel in variants.items():
            gen, model, optimizer, losses = train(tmp, parallel, accum)
            out["runs"][(name, accum)] = (losses, weights(gen, model))
            out["state_bytes"][(name, accum)] = state_bytes(optimizer)
    return out


def checkpoint_rank(tmp: str, four_rank_dir: str | None) -> dict:
    """Save/load round trips of every format, and loading a 4-rank shard set here."""
    out: dict = {}
    for strategy, sync in (("zero1", "bucketed"), ("zero1", "native"), ("zero2", "bucketed")):
        parallel = {"strategy": strategy, "zero": {"parameter_sync": sync}}
        gen, model, optimizer, _ = train(tmp, parallel, steps=4)
        saved = full_optim(gen, model, optimizer)
        folder = Path(tmp, f"{strategy}_{sync}")
        auto = gen.save_optimizer(output_folder=str(folder), filename="auto.pth")
        full = gen.save_optimizer(
            output_folder=str(folder), filename="full.pth", state_format="full"
        )
        files = sorted(p.name for p in folder.iterdir())
        for fmt, path in (("auto", auto), ("full", full)):
            gen2, model2, optimizer2, _ = train(tmp, parallel, steps=0)
            gen2._entry(model2).strategy.load_optimizer_file(optimizer2, model2, path)
            out[(strategy, sync, fmt)] = (saved, full_optim(gen2, model2, optimizer2), files)
        # zero -> ddp and back, through the consolidated file.
        gen3, model3, optimizer3, _ = train(tmp, {"strategy": "ddp"}, steps=0)
        gen3._entry(model3).strategy.load_optimizer_file(optimizer3, model3, full)
        out[(strategy, sync, "into_ddp")] = (saved, full_optim(gen3, model3, optimizer3), files)
    # DCP round trip under zero1.
    gen, model, optimizer, _ = train(tmp, {"strategy": "zero1"}, steps=3)
    saved = full_optim(gen, model, optimizer)
    gen.save_model_state(Path(tmp, "dcp"), model=model, optimizer=optimizer)
    gen2, model2, optimizer2, _ = train(tmp, {"strategy": "zero1"}, steps=0)
    gen2.load_model_state(Path(tmp, "dcp"), model=model2, optimizer=optimizer2)
    out["dcp"] = (saved, full_optim(gen2, model2, optimizer2))
    out["dcp_weights"] = (weights(gen, model), weights(gen2, model2))
    if four_rank_dir is not None:
        gen4, model4, optimizer4, _ = train(tmp, {"strategy": "zero1"}, steps=0)
        path = Path(four_rank_dir, "auto.pth")
        gen4._entry(model4).strategy.load_optimizer_file(optimizer4, model4, path)
        out["from_4"] = full_optim(gen4, model4, optimizer4)
    return out


def master_rank(tmp: str) -> dict:
    """bf16 model with and without FP32 master weights, next to an fp32 reference run."""
    # zero1 and zero2 equal DDP (tested above), so one fp32 and one plain bf16 run serve both.
    gen, model, _, _ = train(tmp, {"strategy": "zero1"})
    out = {"fp32": weights(gen, model)}
    gen, model, _, _ = train(tmp, {"strategy": "zero1"}, precision={"cast_model": "bf16"})
    out["bf16"] = weights(gen, model)
    for strategy in ("ddp", "zero1", "zero2"):
        gen, model, optimizer, _ = train(
            tmp, {"strategy": strategy}, precision={"cast_model": "bf16"}, fp32_master_weights=True
        )
        masters = {k: v["master"] for k, v in full_optim(gen, model, optimizer)["state"].items()}
        raw = {k: v.detach().clone() for k, v in gen.unwrap(model).named_parameters()}
        out[strategy] = (masters, raw)
    return out


def four_rank(tmp: str) -> dict:
    out = {"runs": {}}
    for name in ("ddp", "zero1_bucketed", "zero2", "zero1_native"):
        parallel = {"strategy": "ddp"} if name == "ddp" else ZERO_VARIANTS[name]
        gen, model, optimizer, losses = train(tmp, parallel, accum=2)
        out["runs"][name] = (losses, weights(gen, model))
        if name == "zero1_bucketed":
            out["saved"] = full_optim(gen, model, optimizer)
            gen.save_optimizer(output_folder=tmp, filename="auto.pth")
    return out


# -- fixtures: one launch per world size -------------------------------------------------------
@pytest.fixture(scope="module")
def four(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("four")
    return run_ranks(four_rank, 4, str(tmp))[0], tmp


@pytest.fixture(scope="module")
def two(tmp_path_factory, four):
    tmp = tmp_path_factory.mktemp("two")
    return run_ranks(_all_two_rank, 2, str(tmp), str(four[1]))


def _all_two_rank(tmp: str, four_dir: str) -> dict:
    return {
        "equivalence": equivalence_rank(tmp),
        "checkpoint": checkpoint_rank(tmp, four_dir),
        "master": master_rank(tmp),
    }


# -- assertions ----------------------------------------------------------------------------------
def assert_same_run(run, reference, name):
    losses, final = run
    ref_losses, ref_final = reference
    assert len(losses) == STEPS, name
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=name
    )
    for key in ref_final:
        torch.testing.assert_close(
            final[key], ref_final[key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}"
        )


def assert_same_optim(actual, expected, what):
    assert set(actual["state"]) == set(expected["state"]), what
    for fqn, state in expected["state"].items():
        assert set(actual["state"][fqn]) == set(state), f"{what}: {fqn}"
        for key, value in state.items():
            torch.testing.assert_close(actual["state"][fqn][key], value, msg=f"{what}: {fqn}.{key}")
    hyper = [
        {k: v for k, v in g.items() if k not in ("params", "foreach", "fused")}
        for g in expected["param_groups"]
    ]
    got = [
        {k: v for k, v in g.items() if k not in ("params", "foreach", "fused")}
        for g in actual["param_groups"]
    ]
    assert _lists(got) == _lists(hyper), what


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("name", sorted(ZERO_VARIANTS))
def test_two_ranks_equal_ddp(two, name, accum):
    runs = two[0]["equivalence"]["runs"]
    assert_same_run(runs[(name, accum)], runs[("ddp", accum)], f"{name} accum={accum}")


def test_ranks_agree_on_weights(two):
    rank0, rank1 = (r["equivalence"]["runs"][("zero2", 2)][1] for r in two)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key


@pytest.mark.parametrize("name", ["zero1_bucketed", "zero2", "zero1_native"])
def test_four_ranks_equal_ddp(four, name):
    runs = four[0]["runs"]
    assert_same_run(runs[name], runs["ddp"], f"4 ranks {name}")


@pytest.mark.parametrize("name", ["zero1_bucketed", "zero2", "zero1_native"])
def test_optimizer_state_is_partitioned(two, name):
    per_rank = [r["equivalence"]["state_bytes"][(name, 1)] for r in two]
    ddp = two[0]["equivalence"]["state_bytes"][("ddp", 1)]
    assert sum(per_rank) >= ddp  # together they hold everything (plus padding)
    for got in per_rank:
        assert got <= ddp / 2 * 1.15, (name, per_rank, ddp)  # about 1/dp each


@pytest.mark.parametrize("fmt", ["auto", "full", "into_ddp"])
@pytest.mark.parametrize(
    "variant", [("zero1", "bucketed"), ("zero1", "native"), ("zero2", "bucketed")]
)
def test_optimizer_file_round_trip(two, variant, fmt):
    saved, loaded, files = two[0]["checkpoint"][(*variant, fmt)]
    assert "auto.pth.shard00001-of-00002" in files and "full.pth" in files, files
    assert_same_optim(loaded, saved, f"{variant} {fmt}")


def test_dcp_round_trip(two):
    saved, loaded = two[0]["checkpoint"]["dcp"]
    assert_same_optim(loaded, saved, "dcp")
    before, after = two[0]["checkpoint"]["dcp_weights"]
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0)


def test_four_rank_shards_load_into_two_ranks(two, four):
    assert_same_optim(two[0]["checkpoint"]["from_4"], four[0]["saved"], "4 -> 2 ranks")
    assert_same_optim(two[1]["checkpoint"]["from_4"], four[0]["saved"], "4 -> 2 ranks, rank 1")


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_master_weights_track_fp32(two, strategy):
    out = two[0]["master"]
    reference, plain_bf16 = out["fp32"], out["bf16"]
    masters, raw = out[strategy]
    err_master = max((masters[k] - reference[k]).abs().max().item() for k in masters)
    err_plain = max((plain_bf16[k] - reference[k]).abs().max().item() for k in masters)
    for key, master in masters.items():
        assert master.dtype == torch.float32 and raw[key].dtype == torch.bfloat16
        assert torch.equal(raw[key], master.to(torch.bfloat16)), key  # params are its rounding
    # The bf16 forward/backward still differs from fp32, but the master keeps the small
    # AdamW updates that a bf16 parameter rounds away.
    assert err_master < err_plain / 2, (err_master, err_plain)
    assert err_master < 2e-2, err_master


def _lists(groups: list[dict]) -> list[dict]:
    # torch's own full state and JSON both may turn tuples (Adam's betas) into lists.
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]
