"""Regional compile under every strategy (gloo, CPU ranks): compiled == eager.

Inductor would build C++ kernels for minutes on a CI CPU, so the ranks compile with
``aot_eager``: the same Dynamo graphs, guards and AOTAutograd split, executed eagerly. The
GPU tests (tests/gpu/test_perf_gpu.py) cover inductor itself.
"""

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.runs import full_weights, train_tiny

pytestmark = pytest.mark.slow


def train(strategy: str, compile_: bool) -> dict:
    import litegen.compile

    real = litegen.compile.compile_blocks
    regions: list[str] = []

    def aot_eager(model, cfg, **_):
        regions.extend(real(model, cfg, backend="aot_eager"))
        return regions

    litegen.compile.compile_blocks = aot_eager
    gen, model, losses = train_tiny(
        {
            "max_steps": 5,
            "optimization": {
                "parallel": {"strategy": strategy},
                "compile": {"enabled": compile_},
                "memory": {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.5}},
            },
        }
    )
    return {
        "losses": losses,
        "state": full_weights(gen, model),
        "regions": list(regions),
    }


@pytest.mark.parametrize(
    ("strategy", "world", "nodes"),
    [("ddp", 2, 1), ("zero1", 2, 1), ("zero2", 2, 1), ("fsdp2", 2, 1), ("hsdp", 4, 2)],
)
def test_compiled_blocks_train_like_eager(strategy, world, nodes):
    local = world // nodes
    eager = run_ranks(train, world, strategy, False, local_world_size=local)[0]
    compiled = run_ranks(train, world, strategy, True, local_world_size=local)[0]
    assert compiled["regions"] == ["blocks.0", "blocks.1", "blocks.2"] and eager["regions"] == []
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
    for name, value in eager["state"].items():
        torch.testing.assert_close(compiled["state"][name], value, rtol=1e-5, atol=1e-6)
