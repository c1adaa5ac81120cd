"""fsdp2 on one rank trains the model unwrapped, with the results and checkpoints of the
wrapped layout: a LoRA fine-tuning run under the bf16-mixed preset, with EMA, clipping and
accumulation, gives the same losses, weights, EMA and checkpoint keys, and a checkpoint of
either layout resumes in the other."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import FSDPModule

import litegen
from litegen.parallel.fsdp2 import Fsdp2Strategy
from litegen.trainer import Trainer
from litegen.utils.config import MainConfig

pytest.importorskip("peft")


@pytest.fixture(autouse=True)
def _own_process_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.to_q(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def samples(n: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, generator=gen), torch.randn(2, generator=gen)) for _ in range(n)]


def train_step(batch, model):
    data, target = batch
    noisy = data + 0.1 * torch.randn_like(data)  # the global RNG, as the objectives draw
    return nn.functional.mse_loss(model(noisy).float(), target)


def run(tmp_path, monkeypatch, *, unwrapped: bool, steps: int, **trainer) -> dict:
    monkeypatch.setattr(Fsdp2Strategy, "unwrap_single_rank", unwrapped)
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path / "results"),
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "global_batch_size": 4,
            "max_steps": steps,
            "optimization": {
                "parallel": {"strategy": "fsdp2"},
                "precision": {"preset": "bf16-mixed"},
                "lora": {"rank": 4, "target_modules": ["to_q"]},
            },
            "ema": {"enable": True, "decay": 0.9},
            "trainer": {
                "log_every": 1,
                "save_final": False,
                "max_grad_norm": 0.5,
                "grad_accum_steps": 2,
                **trainer,
            },
        }
    )
    gen = litegen.initialize(config)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, loader = gen.prepare(model, optimizer, samples())
    trainer_ = Trainer(gen, train_step, {"model": model, "optimizer": optimizer, "loader": loader})
    losses = trainer_.fit()
    return {
        "losses": losses,
        "sharded": isinstance(model, FSDPModule),
        "weights": gen.full_model_state(model),
        "ema": gen.full_ema_state(),
    }


def checkpoint_keys(folder) -> set[str]:
    """The keys of every DCP checkpoint under ``folder`` (model, optimizer, EMA)."""
    keys = set()
    for metadata in folder.rglob(".metadata"):
        keys |= set(FileSystemReader(str(metadata.parent)).read_metadata().state_dict_metadata)
    return keys


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_one_rank_trains_unwrapped_with_the_wrapped_results_and_checkpoints(
    tmp_path, monkeypatch, caplog
):
    wrapped = run(tmp_path / "wrapped", monkeypatch, unwrapped=False, steps=4, checkpoint_every=2)
    with caplog.at_level(logging.INFO, logger="litegen"):
        plain = run(tmp_path / "plain", monkeypatch, unwrapped=True, steps=4, checkpoint_every=2)
    assert wrapped["sharded"] and not plain["sharded"]
    assert "fsdp2 on one rank: training unwrapped" in caplog.text
    assert plain["losses"] == wrapped["losses"]
    assert_equal_states(plain["weights"], wrapped["weights"])
    assert_equal_states(plain["ema"], wrapped["ema"])
    keys = checkpoint_keys(tmp_path / "plain" / "ckpt")
    assert keys and keys == checkpoint_keys(tmp_path / "wrapped" / "ckpt")


@pytest.mark.parametrize("first, then", [(True, False), (False, True)])
def test_a_checkpoint_of_either_layout_resumes_in_the_other(tmp_path, monkeypatch, first, then):
    straight = run(tmp_path / "straight", monkeypatch, unwrapped=then, steps=4)
    run(tmp_path / "split", monkeypatch, unwrapped=first, steps=2, checkpoint_every=2)
    resumed = run(
        tmp_path / "split",
        monkeypatch,
        unwrapped=then,
        steps=4,
        resume_run=str(tmp_path / "split" / "ckpt"),
    )
    assert resumed["losses"] == straight["losses"][2:]
    assert_equal_states(resumed["weights"], straight["weights"])
    assert_equal_states(resumed["ema"], straight["ema"])


def test_what_works_through_the_wrap_keeps_it_on_one_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(Fsdp2Strategy, "unwrap_single_rank", True)
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path),
            "optimization": {
                "parallel": {"strategy": "fsdp2"},
                "precision": {"fsdp_mixed": {"param_dtype": "bf16"}},
            },
        }
    )
    gen = litegen.initialize(config)
    model = Net()
    model, _ = gen.prepare(model, torch.optim.AdamW(model.parameters()))
    assert isinstance(model, FSDPModule)
