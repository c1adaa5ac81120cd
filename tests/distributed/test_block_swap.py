"""Block swap through ``prepare`` on gloo ranks (ddp, 2 ranks and 1): the same losses and
weights as the same LoRA run without it, with checkpointing on some blocks."""

from __future__ import annotations

import peft  # noqa: F401
import pytest

# Imported in the parent so the forked ranks inherit them (LoRA goes through peft).
import litegen.lora  # noqa: F401
from tests.distributed.harness import run_ranks
from tests.distributed.runs import full_weights, train_tiny

LORA = {"rank": 4, "alpha": 8, "target_modules": ["mlp.0", "mlp.2", "ada"]}
CHECKPOINT = {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.34}}


def swap_suite() -> dict:
    out = {}
    for swap in (None, {"blocks_on_device": 1}):
        memory = CHECKPOINT | ({"block_swap": swap} if swap else {})
        gen, model, losses = train_tiny(
            {"max_steps": 3, "optimization": {"lora": LORA, "memory": memory}}
        )
        report = gen.models[-1].memory
        stats = report.block_swap.stats if report.block_swap else None
        out[swap is not None] = {
            "losses": losses,
            "weights": full_weights(gen, model),
            "fetches": stats.fetches if stats else 0,
            "swapped": report.block_swap.swapped if report.block_swap else [],
        }
    return out


@pytest.mark.parametrize("world_size", [2, 1])
def test_block_swap_trains_as_without_it(world_size):
    runs = run_ranks(swap_suite, world_size)[0]
    plain, swapped = runs[False], runs[True]
    assert swapped["swapped"] == ["blocks.1", "blocks.2"] and swapped["fetches"] >= 4 * 3
    assert swapped["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert sorted(swapped["weights"]) == sorted(plain["weights"])
    for name, value in plain["weights"].items():
        assert swapped["weights"][name].equal(value), name
