"""Every strategy on 2 GPUs with NCCL gives DDP's losses and weights (issue 3's GPU proof).

    python3 -m pytest tests/gpu/test_strategies_gpu.py     # on a machine with 2+ GPUs

Skipped without two CUDA devices. fp32 weights, so the tolerance only absorbs NCCL's
reduction order (looser than the gloo tests' 1e-5).
"""

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.runs import full_weights, train_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

STEPS = 20


def train(strategy: str, accum: int) -> dict:
    gen, model, losses = train_tiny(
        {
            "runtime": {"device": "cuda"},
            "max_steps": STEPS,
            "trainer": {"log_every": 1, "save_final": False, "grad_accum_steps": accum},
            "optimization": {"parallel": {"strategy": strategy}},
        }
    )
    return {"losses": losses, "state": full_weights(gen, model)}


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp1", "fsdp2"])
def test_strategy_matches_ddp_over_nccl(strategy, accum):
    reference = run_ranks(train, 2, "ddp", accum, start_method="spawn")[0]
    result = run_ranks(train, 2, strategy, accum, start_method="spawn")[0]
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-4, atol=1e-5)
    for name, value in reference["state"].items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-4, atol=1e-5)
