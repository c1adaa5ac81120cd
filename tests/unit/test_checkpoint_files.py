"""Checkpoint names, atomic writes, the table of formats, and loads that name what is wrong."""

import json
import os
import re
import stat
import subprocess
import sys
import textwrap

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
from litegen.checkpoint.formats import FORMATS, format_for_name, format_of, state_format
from litegen.checkpoint.zero_state import MANIFEST_FORMAT, load_optimizer_state


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


def test_every_row_of_the_format_table_is_a_format_of_that_name():
    for name in FORMATS:
        assert state_format(name).name == name
    assert state_format("zero_sharded").manifest_tag == MANIFEST_FORMAT
    with pytest.raises(ValueError, match="unknown checkpoint format 'npz'; use one of diffusers"):
        state_format("npz")


def test_one_place_tells_the_formats_apart(tmp_path):
    save_state({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    save_state({"w": torch.ones(2)}, tmp_path / "m.pth")
    manifest = tmp_path / "o.optim_state.pth"
    manifest.write_text(json.dumps({"format": MANIFEST_FORMAT}))
    assert format_of(tmp_path / "m.safetensors", "model").name == "safetensors"
    assert format_of(tmp_path / "m.pth", "optimizer").name == "torch"
    assert format_of(manifest, "optimizer").name == "zero_sharded"
    assert format_of(tmp_path, "model").name == "diffusers"  # folders are diffusers' or refused
    # Each kind of state is read only from the formats that can hold it, and a plain state
    # file from the single files.
    assert format_of(manifest, "model").name == "torch"
    assert format_of(tmp_path, "optimizer").name == "torch"
    assert format_of(tmp_path).name == format_of(manifest).name == "torch"
    assert format_for_name("new.lora.safetensors").name == "safetensors"
    assert format_for_name("new.ckpt").name == "torch"


def test_a_foreign_json_file_is_not_taken_for_a_zero_manifest(tmp_path):
    path = tmp_path / "o.optim_state.pth"
    path.write_text(json.dumps({"format": "someone.else"}))
    with pytest.raises(ValueError, match="is JSON but not a LiteGen sharded optimizer manifest"):
        load_optimizer_state(path)


def test_the_run_folder_names_import_without_torch():
    # The CLI reads run folders before any rank starts; torch would cost it seconds.
    snippet = textwrap.dedent(
        """
        import sys
        import litegen.checkpoint.layout, litegen.checkpoint.formats, litegen.checkpoint.step_dirs
        import litegen.checkpoint.atomic
        import litegen_cli.run_folder, litegen_cli.run_lock, litegen_cli.resume
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not loaded, loaded[:5]
        """
    )
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("umask", [0o002, 0o027, 0o077])
def test_atomic_files_get_the_mode_of_an_ordinary_write(tmp_path, umask):
    from litegen.checkpoint.atomic import atomic_write_text

    previous = os.umask(umask)
    try:
        written = atomic_write_text(tmp_path / "a.txt", "x")
        (tmp_path / "b.txt").write_text("x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE((tmp_path / "b.txt").stat().st_mode)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
