"""Block swap and FP8 base weights through ``prepare`` on gloo ranks (ddp, 2 ranks and 1):
the same losses and weights as the same LoRA run without block swap, with checkpointing on some
blocks; with FP8 bases, losses close to full precision's and fewer bytes streamed. With both and
``selective_ratio: auto``, the same training as the fixed plan the planner chose."""

from __future__ import annotations

import peft  # noqa: F401
import pytest

# Imported in the parent so the forked ranks inherit them (LoRA goes through peft).
import litegen.lora  # noqa: F401
from tests.distributed.harness import run_ranks
from tests.distributed.runs import full_weights, planned_and_fixed, train_tiny

LORA = {"rank": 4, "alpha": 8, "target_modules": ["mlp.0", "mlp.2", "ada"]}
CHECKPOINT = {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.34}}


def swap_suite() -> dict:
    out = {}
    swap = {"block_swap": {"blocks_on_device": 1}}
    for name, memory, lora in (
        ("plain", CHECKPOINT, LORA),
        ("swapped", CHECKPOINT | swap, LORA),
        ("fp8", CHECKPOINT | swap, LORA | {"fp8_base": "rowwise"}),
    ):
        gen, model, losses = train_tiny(
            {"max_steps": 3, "optimization": {"lora": lora, "memory": memory}}
        )
        report = gen.models[-1].memory
        stats = report.block_swap.stats if report.block_swap else None
        out[name] = {
            "losses": losses,
            "weights": full_weights(gen, model),
            "fetches": stats.fetches if stats else 0,
            "bytes": stats.bytes_streamed if stats else 0,
            "swapped": report.block_swap.swapped if report.block_swap else [],
            "fp8": type(gen.unwrap(model).blocks[1].mlp[0].base_layer).__name__,
        }
    return out


def assert_swap_changes_nothing(runs: dict) -> None:
    plain, swapped = runs["plain"], runs["swapped"]
    assert swapped["swapped"] == ["blocks.1", "blocks.2"] and swapped["fetches"] >= 4 * 3
    assert swapped["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert sorted(swapped["weights"]) == sorted(plain["weights"])
    for name, value in plain["weights"].items():
        assert swapped["weights"][name].equal(value), name


def test_block_swap_trains_as_without_it_on_2_ranks():
    assert_swap_changes_nothing(run_ranks(swap_suite, 2)[0])


def test_on_1_rank_block_swap_changes_nothing_and_fp8_bases_stream_fewer_bytes():
    runs = run_ranks(swap_suite, 1)[0]
    assert_swap_changes_nothing(runs)
    plain, swapped, fp8 = runs["plain"], runs["swapped"], runs["fp8"]
    assert fp8["fp8"] == "FP8Linear" and plain["fp8"] == "Linear"
    assert fp8["losses"] == pytest.approx(plain["losses"], rel=2e-2)
    assert fp8["losses"] != plain["losses"]  # the weights did change
    assert fp8["fetches"] == swapped["fetches"]
    assert fp8["bytes"] < 0.6 * swapped["bytes"]  # the Linear weights: 1 byte instead of 4


def auto_suite() -> dict:
    """Block swap, FP8 bases and ``selective_ratio: auto``, then the plan it chose fixed."""
    lora = LORA | {"fp8_base": "rowwise"}

    def run(checkpoint: dict) -> dict:
        memory = {"block_swap": {"blocks_on_device": 1}, "activation_checkpoint": checkpoint}
        gen, model, losses = train_tiny(
            {"max_steps": 3, "optimization": {"lora": lora, "memory": memory}}
        )
        report = gen.models[-1].memory
        plan = report.planner.plan if report.planner is not None else None
        weights = full_weights(gen, model)
        checkpointed = report.checkpointed
        return {
            "report": report,
            "plan": plan,
            "checkpointed": checkpointed,
            "losses": losses,
            "weights": weights,
        }

    planned, reference = planned_and_fixed(run)
    chosen = planned["checkpointed"]
    return {
        "chosen": chosen,
        "swapped": planned["report"].block_swap.swapped,
        "described": planned["report"].describe(),
        "fixed": reference["report"].checkpointed,
        "fetches": [r["report"].block_swap.stats.fetches for r in (planned, reference)],
        "losses": (planned["losses"], reference["losses"]),
        "weights": (planned["weights"], reference["weights"]),
    }


@pytest.mark.parametrize("world_size", [2, 1])
def test_auto_with_block_swap_and_fp8_bases_trains_as_its_fixed_plan(world_size):
    results = run_ranks(auto_suite, world_size)
    runs = results[0]
    assert all(r["chosen"] == runs["chosen"] for r in results)  # every rank plans alike
    assert len(runs["chosen"]) == 1 and runs["fixed"] == runs["chosen"]
    assert set(runs["swapped"]) - set(runs["chosen"])  # a swapped block keeps its activations
    assert ", ".join(runs["chosen"]) in runs["described"]
    planned, fixed = runs["losses"]
    assert planned == fixed
    assert runs["fetches"][0] == runs["fetches"][1]  # measuring fetched nothing twice
    planned, fixed = runs["weights"]
    assert sorted(planned) == sorted(fixed)
    for name, value in fixed.items():
        assert planned[name].equal(value), name
