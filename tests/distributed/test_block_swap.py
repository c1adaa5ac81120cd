"""Block swap and FP8 base weights through ``prepare`` on gloo ranks (ddp, 2 ranks and 1):
the same losses and weights as the same LoRA run without block swap, with checkpointing on some
blocks; with FP8 bases, losses close to full precision's and fewer bytes streamed."""

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
