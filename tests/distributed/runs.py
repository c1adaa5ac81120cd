"""One tiny training run through LiteGen's real loop, for tests that compare runs.

Call inside a rank (``harness.run_ranks``): ``train_tiny`` initializes LiteGen from ``fields``,
prepares the tiny DiT with AdamW and the pair dataset, and trains ``max_steps`` steps.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch

from tests.distributed.models import PairDataset, loss_fn, make_model

# Of the tiny DiT's 3 blocks, blocks 1 and 2 checkpointed; blocks 0 and 1 offloaded (the last
# block keeps its own): block 0 everything it saves, block 1 its inputs.
CHECKPOINT_AND_OFFLOAD = {
    "activation_checkpoint": {"enabled": True, "selective_ratio": 0.34},
    "activation_offload": True,
}


def train_tiny(fields: dict[str, Any]):
    """Returns ``(gen, model, losses)``; ``fields`` are MainConfig fields over test defaults.

    ``fields["trainer"]`` is merged into the default trainer section, not put in its place.
    """
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    # Metrics go to a folder of this run's own, never to results/ in the working directory.
    with tempfile.TemporaryDirectory(prefix="litegen-test-") as results:
        defaults = {
            "runtime": {"device": "cpu"},
            "results_dir": results,
            "global_batch_size": 8,
            "trainer": {"log_every": 1, "save_final": False},
        }
        trainer = defaults["trainer"] | fields.get("trainer", {})
        config = MainConfig.from_dict(defaults | fields | {"trainer": trainer})
        gen = litegen.initialize(config)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(40))
        parts = {"model": model, "optimizer": optimizer, "loader": loader}
        losses = Trainer(gen, lambda batch, model: loss_fn(model, batch), parts).fit()
    return gen, model, losses


def full_weights(gen, model) -> dict[str, torch.Tensor]:
    """The whole model on CPU, copied (on a CPU run the state may alias the parameters)."""
    state = gen.full_model_state(model)
    return {name: value.detach().cpu().clone() for name, value in state.items()}


def planned_and_fixed(run: Callable[[dict], dict]) -> tuple[dict, dict]:
    """``run(activation_checkpoint)`` with ``selective_ratio: auto`` at a budget with room for
    about two blocks' activations, then with the blocks it checkpointed fixed; both results.

    ``run`` returns a dict holding the planner's ``plan`` and the ``checkpointed`` block paths.
    """

    def auto(budget_bytes: float) -> dict:
        gib = budget_bytes / 2**30
        return {"enabled": True, "selective_ratio": "auto", "memory_budget_gib": gib}

    all_in = run(auto(1))["plan"].estimate_bytes  # nothing fits: the smallest estimate
    all_out = run(auto(2**40))["plan"].estimate_bytes
    planned = run(auto(all_in + 0.75 * (all_out - all_in)))
    fixed = {"enabled": True, "selective_ratio": 0.0, "target_paths": planned["checkpointed"]}
    return planned, run(fixed)
