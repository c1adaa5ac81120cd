"""The entry module's contract before any rank starts, every problem in one round, and how
the ``build(config)`` dict is read (one process)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from typer.testing import CliRunner

from litegen.config import MainConfig
from litegen.entry import built_kind, parts_to_prepare
from litegen_cli.app import app
from litegen_cli.entry_check import entry_problems

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOOD = """
import torch

def build(config):
    return {"model": None, "optimizer": None, "dataset": None, "held_out": None}

def train_step(batch, model, step):
    return 0

def validate(model, held_out, gen):
    return 0
"""


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


@pytest.fixture(autouse=True)
def _own_process_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def write_entry(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "my_entry.py"
    path.write_text(textwrap.dedent(code))
    return path


def write_recipe(tmp_path: Path, entry: str = "my_entry.py", **extra) -> Path:
    data = {
        "launch": {"entry": entry, "nproc_per_node": 2},
        "exp_name": "tiny",
        "results_dir": str(tmp_path / "results"),
        "runtime": {"device": "cpu"},
        "max_steps": 2,
        "global_batch_size": 4,
        **extra,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def invoke(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})
    return result.exit_code, result.output


def test_a_well_formed_entry_has_no_problems(tmp_path):
    assert entry_problems(str(write_entry(tmp_path, GOOD)), tmp_path) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("def build(config)", "def make(config)"), "does not define build;"),
        (("def train_step(", "def step_fn("), "does not define train_step;"),
        (("return 0\n\ndef validate", "return 0 +\n\ndef validate"), "is not valid Python"),
        (("import torch", "import no_such_package_xyz"), "imports 'no_such_package_xyz', which"),
        (("def build(config)", "def build(config, extra)"), "build must take the config"),
        (("def train_step(batch, model, step)", "def train_step()"), "take the batch as its"),
        (("def train_step(batch, model, step)", "def train_step(batch, modle)"), "'modle'"),
        (("def validate(model, held_out, gen)", "def validate(model, val)"), "validate asks for"),
    ],
)
@pytest.mark.parametrize("command", ["inspect-config", "launch"])
def test_a_broken_entry_is_refused_before_the_ranks_start(tmp_path, command, change, message):
    entry = write_entry(tmp_path, GOOD.replace(*change))
    code, out = invoke(command, write_recipe(tmp_path))
    assert code == 2, out
    text = " ".join(out.replace("│", " ").split())
    assert f"field 'launch.entry': entry file '{entry}'" in text
    assert message in text
    assert not (tmp_path / "results").exists()  # nothing written, no rank started


def test_a_module_entry_is_checked_as_its_file(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "entry.py").write_text("def build(config):\n    return {}\n")
    monkeypatch.chdir(tmp_path)
    problems = entry_problems("pkg.entry", tmp_path)
    assert problems == [
        f"field 'launch.entry': entry file '{tmp_path / 'pkg' / 'entry.py'}' does not define "
        "train_step; an entry module defines build(config) -> dict of the objects to prepare, "
        "and train_step(batch, ...) -> loss (docs/cli.md)"
    ]


def test_inspect_config_lists_every_problem_in_one_round(tmp_path):
    recipe = write_recipe(tmp_path, entry="missing.py", global_batch_size=3)
    code, out = invoke("inspect-config", recipe, "optimization.precision.cast_model=fp8")
    assert code == 2, out
    text = " ".join(out.replace("│", " ").split())
    assert "field 'optimization.precision.cast_model': Input should be" in text
    assert f"entry file '{tmp_path / 'missing.py'}' does not exist" in text
    assert "field 'global_batch_size': 3 is not divisible by data-parallel size 2" in text


# -- the build(config) dict -------------------------------------------------------------------


def test_held_out_tuples_lists_and_tensors_are_not_datasets():
    dataset = torch.utils.data.TensorDataset(torch.zeros(4, 2))
    assert built_kind(dataset) == "dataset"
    assert built_kind(torch.utils.data.DataLoader(dataset)) == "dataloader"
    for plain in [(torch.zeros(2), torch.zeros(2)), [1, 2], {"a": 1}, torch.zeros(3), "text"]:
        assert built_kind(plain) is None, plain

    class Rows:  # a Hugging Face datasets.Dataset, say: indexable, sized, no torch base class
        def __getitem__(self, i):
            return i

        def __len__(self):
            return 3

    assert built_kind(Rows()) == "dataset"


def test_build_without_exactly_one_dataset_names_what_it_found():
    model = nn.Linear(2, 2)
    parts = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with pytest.raises(ValueError, match=r"found none\..*'dataset' \(tuple\).*TensorDataset"):
        parts_to_prepare({**parts, "dataset": (torch.zeros(4), torch.zeros(4), 1)}, "e.py")
    two = torch.utils.data.TensorDataset(torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"found 2 \('train', 'val'\)"):
        parts_to_prepare({**parts, "train": two, "val": two}, "e.py")
    with pytest.raises(ValueError, match="returned no optimizer"):
        parts_to_prepare({"model": model, "train": two}, "e.py")


HELD_OUT_ENTRY = """
import torch
from torch import nn


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(16, 4)
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "dataset": torch.utils.data.TensorDataset(x, torch.zeros(16)),
        "held_out": (torch.ones(2, 4), torch.zeros(2, 4)),
    }


def train_step(batch, model):
    x, _ = batch
    return model(x).square().mean()


def validate(model, held_out):
    x, y = held_out
    return nn.functional.mse_loss(model(x), y)
"""


def test_a_held_out_tuple_reaches_validate_as_the_docs_show(tmp_path):
    from litegen.trainer import run_entry

    entry = write_entry(tmp_path, HELD_OUT_ENTRY)
    assert entry_problems(str(entry), tmp_path) == []
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path / "results"),
            "global_batch_size": 4,
            "max_steps": 2,
            "trainer": {"validate_every": 2, "save_final": False},
        }
    )
    run_entry(config, str(entry), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "results" / "metrics.jsonl").open()]
    assert records[-1]["step"] == 2 and records[-1]["val_loss"] > 0
