"""DDP on 2 gloo ranks equals one process on the same global batch, through the real loop."""

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.runs import full_weights, train_tiny

pytestmark = pytest.mark.slow


def train(overrides: dict) -> dict:
    gen, model, losses = train_tiny({"max_steps": 12, **overrides})
    return {"losses": losses, "state": full_weights(gen, model)}


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_two_ranks_match_one_process(accum):
    overrides = {"trainer": {"grad_accum_steps": accum}}
    (single,) = run_ranks(train, 1, overrides)
    ranks = run_ranks(train, 2, overrides)
    assert len(single["losses"]) == 12
    for result in ranks:
        torch.testing.assert_close(result["losses"], single["losses"], rtol=1e-5, atol=1e-6)
        for key, value in single["state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6)
    # The run really trained: the loss went down.
    assert single["losses"][-1] < single["losses"][0]
