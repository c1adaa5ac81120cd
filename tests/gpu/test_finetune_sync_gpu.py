"""A LoRA fine-tuning step on CUDA never makes the host wait for the device: the fine-tuning
recipes' settings (fsdp2 on one rank, trained unwrapped; the bf16-mixed preset's FP32 masters;
the EMA of the adapters; gradient clipping; logging every step) and the flow-matching draws,
under torch's sync debug mode, which raises at any synchronizing CUDA call."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Dataset, default_collate

import litegen
from litegen.objectives import FlowMatching
from litegen.trainer import Trainer
from litegen.utils.config import MainConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("peft")

WATCHED = range(3, 6)  # steps run under the sync debug mode: warm-up before, the end after


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.nn.functional.gelu(self.to_q(x)))


class Denoiser(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.time = nn.Linear(1, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        x = x + self.time(timestep.reshape(-1, 1, 1).to(x.dtype) / 1000)
        for block in self.blocks:
            x = block(x)
        return x


class Latents(Dataset):
    """Cached latents as the fine-tuning recipes read them: dicts of tensors."""

    collate_fn = staticmethod(default_collate)

    def __init__(self, count: int = 16) -> None:
        self.latents = torch.randn(count, 16, 64)

    def __len__(self) -> int:
        return len(self.latents)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"latents": self.latents[index]}


def test_a_lora_fine_tuning_step_never_syncs(tmp_path):
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cuda"},
            "results_dir": str(tmp_path),
            "global_batch_size": 2,
            "max_steps": WATCHED.stop,
            "optimization": {
                "parallel": {"strategy": "fsdp2"},
                "precision": {"preset": "bf16-mixed"},
                "lora": {"rank": 4, "target_modules": ["to_q"]},
            },
            "ema": {"enable": True, "decay": 0.9},
            "trainer": {"log_every": 1, "save_final": False, "max_grad_norm": 1.0},
        }
    )
    gen = litegen.initialize(config)
    objective = FlowMatching(density="logit_normal", shift=3.0)
    samples = Latents()
    model = Denoiser()
    model, optimizer, loader = gen.prepare(model, torch.optim.AdamW(model.parameters()), samples)
    assert not isinstance(model, FSDPModule)  # one rank: trained unwrapped

    def train_step(batch, model, step):
        # The mode set here holds until the next step's train_step: this step's forward,
        # backward, clipping, optimizer step, EMA and logged record.
        torch.cuda.set_sync_debug_mode("error" if step in WATCHED else "default")
        x0 = batch["latents"].float()
        noise = torch.randn_like(x0)
        sigmas = objective.sample_sigmas(x0.shape[0], device=x0.device)
        noisy = objective.add_noise(x0, noise, sigmas)
        prediction = model(noisy.to(torch.bfloat16), objective.timesteps(sigmas))
        return objective.loss(prediction, x0, noise, sigmas)

    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    try:
        losses = Trainer(gen, train_step, parts).fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(losses) == WATCHED.stop and all(torch.isfinite(torch.tensor(losses)))
