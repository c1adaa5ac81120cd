"""Features that meet: real diffusers transformers x every strategy x the features users turn on
together, chosen pairwise (tests/distributed/combinations.py, pairwise.py).

Each case asserts numbers: its losses, validation losses and final weights equal the same case
under ddp (on the same ranks), and bit for bit the same case without block swap; a run stopped
at a step-2 checkpoint and resumed equals the straight run, and an exported model (a diffusers
folder) or adapter (a LoRA file) reloaded in plain diffusers predicts what the trained model
predicts (for an fp8 base: the trained adapters over the base before quantization).

The whole matrix (every all-pairs case of every strategy, hsdp on 4 ranks as 2 simulated nodes)
is marked ``matrix`` and deselected by default; run it with

    uv run --locked pytest -m matrix tests/distributed/test_combinations.py

CI runs a sample: for fsdp2, zero2, fsdp1 and ddp, the all-pairs case with the most features on
that the sample has not switched on yet (compile aside); ddp's holds an fp8 base and block swap.
"""

from __future__ import annotations

import functools
import itertools
import tempfile

import pytest
import torch

from tests.distributed.combinations import (
    FEATURES,
    FOUR_RANK_STRATEGIES,
    TWO_RANK_STRATEGIES,
    case_id,
    cases_for,
    features_for,
    run_cases,
    runnable,
    sample_cases,
)
from tests.distributed.harness import run_ranks

MATRIX = {s: cases_for(s) for s in TWO_RANK_STRATEGIES + FOUR_RANK_STRATEGIES}
# ddp last: the only strategy that runs fp8 bases and block swap, which its case then takes.
SAMPLE = sample_cases(MATRIX, ("fsdp2", "zero2", "fsdp1", "ddp"))
ALL = [case for cases in MATRIX.values() for case in cases]
# Combinations that fail today, each with its cause: strict, so a fix turns them into passes.
KNOWN_FAILURES: list[tuple] = []


def params(cases: list[dict]) -> list:
    """The cases as pytest parameters, the known failures marked xfail(strict=True)."""
    out = []
    for case in cases:
        reasons = [reason for applies, reason in KNOWN_FAILURES if applies(case)]
        marks = [pytest.mark.xfail(strict=True, reason=reasons[0])] if reasons else []
        out.append(pytest.param(case, marks=marks, id=case_id(case)))
    return out


TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # fp32; strategies differ in the order of sums


@functools.cache
def results_of(cases: tuple[str, ...]) -> dict:
    """The results of the cases with these ids, run in one group of ranks (4 for hsdp's)."""
    chosen = [c for c in ALL if case_id(c) in cases]
    world = 4 if any(c["strategy"] in FOUR_RANK_STRATEGIES for c in chosen) else 2
    timeout = 240 + 120 * len(chosen)
    with tempfile.TemporaryDirectory(prefix="litegen-test-") as root:
        return run_ranks(run_cases, world, chosen, root, local_world_size=2, timeout_s=timeout)[0]


def check(case: dict, results: dict) -> None:
    got = results[case_id(case)]
    assert not isinstance(got, str), f"{case_id(case)} failed: {got}"
    run = got["run"]
    assert len(run["losses"]) == 4
    if "ddp" in got:
        ddp = got["ddp"]
        torch.testing.assert_close(run["losses"], ddp["losses"], **TOLERANCE)
        torch.testing.assert_close(run["val_losses"], ddp["val_losses"], **TOLERANCE)
        torch.testing.assert_close(run["state"], ddp["state"], **TOLERANCE)
    sample_every, validate_every = {"none": (0, 0), "same_step": (2, 2)}.get(case["hooks"], (2, 3))
    assert sorted(run["val_losses"]) == [
        s for s in (1, 2, 3, 4) if validate_every and s % validate_every == 0
    ]
    assert run["samples"] == [f"step_{s}" for s in (2, 4) if sample_every]
    assert run["encoder_plain"]
    assert (run["swap_fetches"] > 0) == case["block_swap"]
    assert (run["fp8_layers"] > 0) == (case["fp8_base"] is not None)
    if case["block_swap"]:
        # The frozen weights only wait in another memory between uses: bit for bit the same.
        unswapped = got["unswapped"]
        assert run["losses"] == unswapped["losses"]
        assert run["val_losses"] == unswapped["val_losses"]
        torch.testing.assert_close(run["state"], unswapped["state"], rtol=0, atol=0)
    if case["resume"]:
        # The same ranks and strategy: a resumed run continues bit for bit.
        assert got["resumed"]["losses"] == run["losses"]
        torch.testing.assert_close(got["resumed"]["state"], run["state"], rtol=0, atol=0)
    if case["export"]:
        assert run["export_diff"] <= 1e-5, run["export_diff"]


@pytest.mark.parametrize("case", params(SAMPLE))
def test_a_pairwise_sample_of_the_combinations(case):
    check(case, results_of(tuple(case_id(c) for c in SAMPLE)))


@pytest.mark.matrix
@pytest.mark.parametrize("case", params(ALL))
def test_every_pairwise_combination(case):
    results = results_of(tuple(case_id(c) for c in MATRIX[case["strategy"]]))
    check(case, results)


def test_the_cases_meet_every_pair_of_features_under_every_strategy():
    names = list(FEATURES)
    for strategy, cases in MATRIX.items():
        features = features_for(strategy)
        every_case = [
            dict(zip(names, v, strict=True)) for v in itertools.product(*features.values())
        ]
        # The values features_for leaves out are those no case of the strategy can run.
        for name, values in FEATURES.items():
            for value in [v for v in values if v not in features[name]]:
                assert not any(runnable(strategy, c | {name: value}) for c in every_case)
        possible, met = set(), set()
        for found, pool in (
            (possible, [c for c in every_case if runnable(strategy, c)]),
            (met, cases),
        ):
            for case in pool:
                found |= {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}
        assert possible == met, (strategy, sorted(possible - met)[:3])
        assert all(runnable(strategy, case) for case in cases)
