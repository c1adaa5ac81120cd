"""Checkpoints from elsewhere: plain PyTorch state dicts and diffusers folders, in one process.

The two-rank round trip (diffusers folder -> fsdp2 training -> diffusers folder) is the
synthetic DiT run of tests/distributed/test_recipes.py.
"""

from __future__ import annotations

import pytest
import torch

import litegen
from litegen.checkpoint.interop import WEIGHTS, load_diffusers_weights, optimizer_file_for
from litegen.utils.config import MainConfig
from tests.distributed.models import IN_DIM, TOKENS, make_model


def batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        data = torch.randn(4, TOKENS, IN_DIM, generator=gen)
        out.append((data, torch.tanh(data.flip(-1))))
    return out


def step(model, optimizer, batch) -> None:
    data, target = batch
    torch.nn.functional.mse_loss(model(data), target).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def plain_run(folder) -> dict[str, torch.Tensor]:
    """Two steps saved with torch.save, then two more: the weights of a run that never stopped."""
    model = make_model()
    optimizer = adamw(model.parameters())
    data = batches()
    for batch in data[:2]:
        step(model, optimizer, batch)
    torch.save(model.state_dict(), folder / "model.pt")
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    for batch in data[2:]:
        step(model, optimizer, batch)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def initialize(strategy: str = "ddp", **fields) -> litegen.LiteGen:
    config = {"runtime": {"device": "cpu"}, "optimization": {"parallel": {"strategy": strategy}}}
    return litegen.initialize(MainConfig.from_dict({**config, **fields}))


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_plain_state_dicts_resume_like_a_run_that_never_stopped(tmp_path, strategy):
    expected = plain_run(tmp_path)
    gen = initialize(strategy, resume_from=str(tmp_path / "model.pt"))
    model = make_model(seed=1)  # other weights: resume_from must replace them
    model, optimizer = gen.prepare(model, adamw(model.parameters()))
    for batch in batches()[2:]:
        step(model, optimizer, batch)
    torch.testing.assert_close(gen.full_model_state(model), expected, rtol=1e-6, atol=1e-7)


def test_a_plain_optimizer_state_of_another_layout_is_refused_by_name(tmp_path):
    plain_run(tmp_path)
    gen = initialize(resume_from=str(tmp_path / "model.pt"))
    model = make_model()
    backwards = adamw(list(model.parameters())[::-1])
    with pytest.raises(ValueError, match=r"optimizer.pt: state 'exp_avg' of parameter 0.*order"):
        gen.prepare(model, backwards)
    gen = initialize(resume_from=str(tmp_path / "model.pt"))
    model = make_model()
    with pytest.raises(ValueError, match=r"param groups of \[\d+\] parameters, the optimizer has"):
        gen.prepare(model, adamw(model.blocks.parameters()))


def test_a_missing_optimizer_state_lists_where_it_looked(tmp_path):
    torch.save(make_model().state_dict(), tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match=r"weights.optim_state.pth, .*optimizer.bin"):
        optimizer_file_for(tmp_path / "weights.bin")


# -- diffusers folders ---------------------------------------------------------------------------
def tiny_dit(seed: int = 0, **overrides):
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    config = {
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "in_channels": 4,
        "out_channels": 8,
        "num_layers": 2,
        "sample_size": 8,
        "patch_size": 2,
        "num_embeds_ada_norm": 10,
    }
    return DiTTransformer2DModel(**(config | overrides))


def test_init_from_reads_a_sharded_diffusers_folder(tmp_path):
    source = tiny_dit(seed=0)
    source.save_pretrained(tmp_path / "transformer", max_shard_size="20KB")
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 1
    gen = initialize(init_from=str(tmp_path / "transformer"))
    model = gen.prepare(tiny_dit(seed=1))
    for name, tensor in source.state_dict().items():
        assert torch.equal(gen.unwrap(model).state_dict()[name], tensor), name


def test_diffusers_folders_that_do_not_fit_say_why(tmp_path):
    tiny_dit(num_layers=1).save_pretrained(tmp_path / "shallow")
    gen = initialize(init_from=str(tmp_path / "shallow"))
    with pytest.raises(ValueError, match=r"missing keys: transformer_blocks\.1\."):
        gen.prepare(tiny_dit())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a diffusers model folder"):
        initialize(init_from=str(tmp_path / "empty")).prepare(tiny_dit())
    (tmp_path / "shallow" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ValueError, match=f"has no {WEIGHTS[0]}"):
        load_diffusers_weights(tmp_path / "shallow")


def test_resume_from_a_diffusers_folder_takes_accelerates_optimizer_file(tmp_path):
    model = tiny_dit()
    optimizer = adamw(model.parameters())
    x = torch.randn(2, 4, 8, 8)
    out = model(x, timestep=torch.tensor([1, 2]), class_labels=torch.tensor([0, 1])).sample
    out.square().mean().backward()
    optimizer.step()
    model.save_pretrained(tmp_path / "checkpoint-1" / "transformer")
    torch.save(optimizer.state_dict(), tmp_path / "checkpoint-1" / "optimizer.bin")
    gen = initialize(resume_from=str(tmp_path / "checkpoint-1" / "transformer"))
    fresh = tiny_dit(seed=3)
    fresh, resumed = gen.prepare(fresh, adamw(fresh.parameters()))
    saved = optimizer.state_dict()["state"]
    loaded = resumed.state_dict()["state"]
    assert all(torch.equal(saved[i]["exp_avg"], loaded[i]["exp_avg"]) for i in saved)
