"""Checkpoint names, atomic writes, and loads that name what is wrong."""

import os
import re

import pytest
import torch

from litegen.checkpoint import (
    atomic_write,
    check_model_state,
    checkpoint_path,
    load_state,
    optimizer_path_for,
    save_state,
)


@pytest.mark.parametrize(
    ("kind", "step", "filename", "expected"),
    [
        ("model", None, None, "ck/exp.pth"),
        ("optimizer", None, None, "ck/exp.optim_state.pth"),
        ("ema", None, None, "ck/exp.ema.pth"),
        ("model", 10, None, "ck/exp_step10.pth"),
        ("ema", 7, None, "ck/exp_step7.ema.pth"),
        ("model", 10, "mine.safetensors", "ck/mine.safetensors"),
    ],
)
def test_naming_rules(kind, step, filename, expected):
    path = checkpoint_path(kind, default_folder="ck", exp_name="exp", filename=filename, step=step)
    assert str(path) == expected
    out = checkpoint_path(kind, default_folder="ck", exp_name="exp", output_folder="o", step=step)
    assert out.parent.name == "o"


def test_optimizer_file_beside_a_model_file():
    assert optimizer_path_for("a/model_10.pth").name == "model_10.optim_state.pth"
    assert optimizer_path_for("a/model_10.safetensors").name == "model_10.optim_state.pth"


@pytest.mark.parametrize("name", ["m.pth", "m.safetensors"])
def test_round_trip_both_formats(tmp_path, name):
    shared = torch.randn(4, 4)
    state = {"w": shared, "w_t": shared.t(), "b": torch.arange(3)}
    save_state(state, tmp_path / name)
    loaded = load_state(tmp_path / name)
    assert set(loaded) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(loaded[key], value)
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary left behind


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "m.pth"
    save_state({"w": torch.ones(2)}, path)

    def crash(tmp):
        tmp.write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, crash)
    torch.testing.assert_close(load_state(path)["w"], torch.ones(2))
    assert os.listdir(tmp_path) == ["m.pth"]


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.pth"):
        load_state(tmp_path / "nope.pth", what="init_from")


@pytest.mark.parametrize("name", ["m.pth", "m.safetensors"])
def test_truncated_file_names_the_path(tmp_path, name):
    path = tmp_path / name
    save_state({"w": torch.randn(64, 64)}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match=rf"{re.escape(name)} is truncated or not a checkpoint"):
        load_state(path)


def test_mismatched_keys_and_shapes_are_all_listed():
    model = torch.nn.Linear(3, 2).state_dict()
    state = {"weight": torch.zeros(2, 4), "extra": torch.zeros(1)}
    with pytest.raises(ValueError) as err:
        check_model_state(model, state, "ck.pth")
    message = str(err.value)
    assert "missing keys: bias" in message
    assert "unexpected keys: extra" in message
    assert "weight: file (2, 4) vs model (2, 3)" in message
    assert "ck.pth" in message
