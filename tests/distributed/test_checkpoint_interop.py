"""The round trip: a diffusers folder -> LiteGen training on 2 gloo ranks -> a diffusers folder.

A tiny ``DiTTransformer2DModel`` saved with ``save_pretrained`` starts the run (``init_from``),
fsdp2 shards it with an EMA, and ``trainer.export_diffusers`` writes ``<results_dir>/diffusers``,
which diffusers' own ``from_pretrained`` loads with exactly the trained EMA weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.unit.test_checkpoint_interop import tiny_dit

pytestmark = pytest.mark.slow

LR = 1e-3


class Latents(torch.utils.data.Dataset):
    collate_fn = staticmethod(torch.utils.data.default_collate)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        return {"latents": torch.randn(4, 8, 8, generator=gen), "label": torch.tensor(i % 10)}


def train_step(batch, model):
    noise = torch.randn_like(batch["latents"])
    t = torch.rand(len(noise))
    noisy = (1 - t.view(-1, 1, 1, 1)) * batch["latents"] + t.view(-1, 1, 1, 1) * noise
    out = model(noisy, timestep=t * 1000, class_labels=batch["label"]).sample[:, :4]
    return torch.nn.functional.mse_loss(out, noise - batch["latents"])


def round_trip(source: str, results: str) -> dict:
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": results,
            "init_from": source,
            "global_batch_size": 4,
            "max_steps": 3,
            "optimization": {"parallel": {"strategy": "fsdp2"}},
            "ema": {"enable": True, "decay": 0.5},
            "trainer": {"save_final": False, "export_diffusers": True},
        }
    )
    gen = litegen.initialize(config)
    model = tiny_dit(seed=1)  # not the source's weights: init_from replaces them
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer, loader = gen.prepare(model, optimizer, Latents())
    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    Trainer(gen, train_step, parts).fit()
    return {"model": gen.full_model_state(model), "ema": gen.full_ema_state()}


def test_a_diffusers_folder_trains_and_comes_back_as_one(tmp_path):
    from diffusers import DiTTransformer2DModel

    source = tiny_dit(seed=0)
    source.save_pretrained(tmp_path / "source")
    trained = run_ranks(round_trip, 2, str(tmp_path / "source"), str(tmp_path / "run"))[0]
    exported = DiTTransformer2DModel.from_pretrained(tmp_path / "run" / "diffusers")
    assert exported.state_dict().keys() == trained["ema"].keys()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, trained["ema"][name]), name
    # Trained from the source's weights: AdamW moves each weight by about LR per step.
    moved = max(
        (trained["model"][k] - v).abs().max().item() for k, v in source.state_dict().items()
    )
    assert 0 < moved < 4 * LR
