"""initialize and prepare in one process: order, rejections, init/resume, save and load."""

from pathlib import Path

import pytest
import torch
from torch import nn

import litegen
from litegen.utils.config import MainConfig


def make_gen(tmp_path, **fields):
    config = MainConfig.from_dict(
        {"runtime": {"device": "cpu"}, "results_dir": str(tmp_path), "exp_name": "exp", **fields}
    )
    return litegen.initialize(config)


def pairs(n=8):
    return [(torch.randn(3), torch.randn(2)) for _ in range(n)]


def test_initialize_rejects_anything_but_a_main_config():
    with pytest.raises(TypeError, match=r"MainConfig\.load_yaml"):
        litegen.initialize({"runtime": {"device": "cpu"}})


def test_results_come_back_in_argument_order_with_models_first(tmp_path):
    gen = make_gen(tmp_path, global_batch_size=4)
    model, frozen = nn.Linear(3, 2), nn.Linear(2, 2).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # The optimizer comes before its model: prepare still wraps the model first.
    out_opt, loader, out_frozen, out_model = gen.prepare(optimizer, pairs(), frozen, model)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert out_model is model  # ddp on one rank: nothing to all-reduce, so no DDP wrapper
    assert gen.unwrap(out_model) is model and out_opt is optimizer
    assert out_frozen is frozen and not frozen.training
    assert {id(p) for p in out_opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    data, target = next(iter(loader))
    assert data.shape == (4, 3) and target.shape == (4, 2)


def test_functions_and_odd_objects_are_rejected_by_position(tmp_path):
    gen = make_gen(tmp_path)
    vae = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"prepare argument 1 is a builtins.method"):
        gen.prepare(vae, vae.forward)
    with pytest.raises(TypeError, match=r"prepare argument 0 is a builtins.int"):
        gen.prepare(3)


def test_an_optimizer_without_its_model_is_an_error(tmp_path):
    gen = make_gen(tmp_path)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no prepared model"):
        gen.prepare(nn.Linear(2, 2), optimizer)


@pytest.mark.parametrize("filename", [None, "weights.safetensors"])
def test_save_model_then_init_from_and_load(tmp_path, filename):
    gen = make_gen(tmp_path)
    source = nn.Linear(3, 2)
    prepared = gen.prepare(source)
    path = gen.save_model(filename=filename, step=5)
    assert path.name == (filename or "exp_step5.pth")
    assert path.parent == tmp_path

    gen2 = make_gen(tmp_path, init_from=str(path))
    fresh = gen2.prepare(nn.Linear(3, 2))
    torch.testing.assert_close(gen2.unwrap(fresh).weight, source.weight)

    other = gen2.prepare(nn.Linear(3, 2))
    gen2.load(other, path)
    torch.testing.assert_close(gen2.unwrap(other).bias, source.bias)
    assert prepared is not None


def test_resume_from_restores_weights_and_optimizer_state(tmp_path):
    gen = make_gen(tmp_path)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = gen.prepare(model, optimizer)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    gen.save_model(step=1)
    gen.save_optimizer(step=1)

    gen2 = make_gen(tmp_path, resume_from=str(tmp_path / "exp_step1.pth"))
    model2 = nn.Linear(3, 2)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    model2, optimizer2 = gen2.prepare(model2, optimizer2)
    torch.testing.assert_close(gen2.unwrap(model2).weight, gen.unwrap(model).weight)
    state = optimizer2.state[gen2.unwrap(model2).weight]
    torch.testing.assert_close(
        state["exp_avg"], optimizer.state[gen.unwrap(model).weight]["exp_avg"]
    )


def test_loading_a_mismatched_checkpoint_names_file_and_keys(tmp_path):
    gen = make_gen(tmp_path)
    gen.prepare(nn.Linear(3, 2))
    path = gen.save_model()
    with pytest.raises(
        ValueError,
        match=r"exp.pth does not match the model.*weight: file \(2, 3\) vs model \(4, 3\)",
    ):
        make_gen(tmp_path, init_from=str(path)).prepare(nn.Linear(3, 4))
    with pytest.raises(FileNotFoundError, match=r"missing\.pth"):
        make_gen(tmp_path, init_from=str(tmp_path / "missing.pth")).prepare(nn.Linear(3, 2))


def prepared_then_moved(tmp_path, ema: bool):
    """A prepared Linear (EMA decay 0.5 when ``ema``) whose weight then moved by +2.

    Returns ``(gen, model, start)``; ``start`` is the weight before the move.
    """
    gen = make_gen(tmp_path, ema={"enable": ema, "decay": 0.5})
    model = nn.Linear(3, 2)
    start = model.weight.detach().clone()
    model = gen.prepare(model)
    with torch.no_grad():
        gen.unwrap(model).weight.add_(2.0)
    return gen, model, start


def test_ema_tracks_the_weights_and_saves_by_name(tmp_path):
    gen, _, start = prepared_then_moved(tmp_path, ema=True)
    gen.update_ema()
    torch.testing.assert_close(gen.full_ema_state()["weight"], start + 1.0)
    gen.update_ema(decay=0.0)
    torch.testing.assert_close(gen.full_ema_state()["weight"], start + 2.0)
    assert gen.save_ema(step=3).name == "exp_step3.ema.pth"


@pytest.mark.parametrize("ema", [True, False])
def test_sampling_state_is_the_ema_when_on_and_the_model_otherwise(tmp_path, ema):
    gen, model, start = prepared_then_moved(tmp_path, ema)
    if ema:
        gen.update_ema()
    expected = start + 1.0 if ema else start + 2.0
    torch.testing.assert_close(gen.full_sampling_state()["weight"], expected)
    torch.testing.assert_close(gen.full_model_state(model)["weight"], start + 2.0)
    if not ema:
        with pytest.raises(ValueError, match=r"ema\.enable: true"):
            gen.full_ema_state()


def test_global_batch_must_divide_over_ranks_and_accumulation(tmp_path):
    # initialize refuses it with inspect-config's line (litegen.config.strategies).
    with pytest.raises(
        ValueError,
        match=r"^field 'global_batch_size': 6 is not divisible by data-parallel size 1 \* "
        r"trainer\.grad_accum_steps 4 = 4; use a multiple of 4\.$",
    ):
        make_gen(tmp_path, global_batch_size=6, trainer={"grad_accum_steps": 4})


def test_memory_budget_policy_needs_compile(tmp_path):
    memory = {"activation_checkpoint": {"enabled": True, "policy": "memory_budget"}}
    with pytest.raises(ValueError, match=r"optimization\.compile\.enabled \(False\).*set comp"):
        make_gen(tmp_path, optimization={"memory": memory})  # refused with the config


def test_context_parallel_size_must_divide_the_world(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"cp_size': sp_size 1 \* cp_size 2 = 2 does not divide the world size 1 .*launch "
        r"a multiple of 2 ranks, or change sp_size or cp_size",
    ):
        make_gen(tmp_path, optimization={"parallel": {"cp_size": 2}})


def test_sequence_parallel_size_must_divide_the_world(tmp_path):
    with pytest.raises(ValueError, match=r"sp_size': 2 does not divide the world size 1"):
        make_gen(tmp_path, optimization={"parallel": {"sp_size": 2}})


def test_optimizer_backend_applies_only_when_written_in_the_config(tmp_path):
    gen = make_gen(tmp_path)
    model = nn.Linear(3, 2)
    _, optimizer = gen.prepare(model, torch.optim.AdamW(model.parameters(), foreach=True))
    assert optimizer.param_groups[0]["foreach"] is True  # the user's choice survives

    gen = make_gen(tmp_path, optimization={"optimizer": {"backend": "single_tensor"}})
    model = nn.Linear(3, 2)
    _, optimizer = gen.prepare(model, torch.optim.AdamW(model.parameters(), foreach=True))
    assert optimizer.param_groups[0]["foreach"] is False


def test_a_config_written_out_and_read_back_keeps_the_optimizers_own_backend(tmp_path):
    """As `litegen launch` does: its ranks read the resolved recipe, every field written out."""
    written = make_gen(tmp_path).config.to_dict()
    gen = litegen.initialize(MainConfig.from_dict(written))
    model = nn.Linear(3, 2)
    _, optimizer = gen.prepare(model, torch.optim.AdamW(model.parameters(), foreach=True))
    assert optimizer.param_groups[0]["foreach"] is True


def test_a_failed_model_state_save_keeps_the_previous_one(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    gen = make_gen(tmp_path)
    model = gen.prepare(nn.Linear(3, 2))
    saved = gen.unwrap(model).weight.detach().clone()
    target = tmp_path / "state"
    gen.save_model_state(target, model=model)

    def dies_midway(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "half.distcp").write_bytes(b"partial")
        raise RuntimeError("killed")

    monkeypatch.setattr(dcp, "save", dies_midway)
    with torch.no_grad():
        gen.unwrap(model).weight.add_(1.0)
    with pytest.raises(RuntimeError, match="killed"):
        gen.save_model_state(target, model=model)
    monkeypatch.undo()
    assert not (target / "half.distcp").exists()
    gen.load_model_state(target, model=model)
    torch.testing.assert_close(gen.unwrap(model).weight, saved)


class WithTables(nn.Module):
    """A model with a frozen part, a persistent buffer and a non-persistent one (a RoPE-like
    table that state dicts leave out)."""

    def __init__(self) -> None:
        super().__init__()
        self.trained, self.frozen = nn.Linear(3, 2), nn.Linear(2, 2).requires_grad_(False)
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def test_the_ema_averages_trainable_parameters_and_saves_what_loads_back(tmp_path):
    gen = make_gen(tmp_path, ema={"enable": True, "decay": 0.5})
    model = gen.prepare(WithTables())
    with torch.no_grad():
        model.trained.weight.add_(2.0)
        model.frozen.weight.add_(2.0)  # changed behind the EMA's back: it is not averaged
    gen.update_ema()
    full = gen.full_ema_state()
    assert set(full) == set(model.state_dict())  # frozen included, the table left out
    torch.testing.assert_close(full["frozen.weight"], model.frozen.weight)
    torch.testing.assert_close(full["trained.weight"], model.trained.weight - 1.0)
    path = gen.save_ema()
    again = make_gen(tmp_path, ema={"enable": True, "resume_from": str(path)})
    again.prepare(WithTables())
    torch.testing.assert_close(again.full_ema_state()["trained.weight"], full["trained.weight"])
