"""Files from elsewhere never run code: a crafted DCP checkpoint is refused, naming the file,
before anything in it is built; every read of a user's file is a checked one."""

from __future__ import annotations

import ast
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from litegen.checkpoint.dcp_reader import CheckedLoadPlanner, CheckedReader, read_dcp_metadata
from litegen.checkpoint.manifest import write_manifest
from litegen.checkpoint.step_dirs import resolve_checkpoint
from litegen.config.main import YamlLoader
from tests.unit.test_run_state import run

SOURCES = [
    Path(__file__).resolve().parents[2] / tree
    for tree in ("litegen_core/src/litegen", "litegen_cli/src/litegen_cli")
]


class Payload:
    """Unpickling it runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _no_dist_load(state: dict, folder: Path, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, no_dist=True, **kwargs)


def test_a_crafted_metadata_file_is_refused_before_it_runs(tmp_path):
    run(tmp_path, 2, checkpoint_every=2)
    step = tmp_path / "ckpt" / "step_2"
    meta = step / "model_0" / ".metadata"
    good = read_dcp_metadata(meta)  # the real one reads back
    assert "model.weight" in good.state_dict_metadata
    marker = tmp_path / "ran"
    meta.write_bytes(pickle.dumps(Payload(marker)))
    write_manifest(step)  # whoever crafted it wrote a matching manifest too
    with pytest.raises(ValueError, match=rf"{re.escape(str(meta))} .*builtins\.exec"):
        resolve_checkpoint(step)
    with pytest.raises(CheckpointException, match=r"builtins\.exec, which DCP metadata never"):
        _no_dist_load(
            {"model.weight": torch.empty(2, 4)}, step, storage_reader=CheckedReader(meta.parent)
        )
    with pytest.raises(ValueError, match=r"builtins\.exec"):
        run(tmp_path / "new", 4, resume_run=str(step))
    assert not marker.exists()


def test_a_crafted_value_in_a_dcp_shard_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "model_0"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"w": torch.ones(2), "lr": Payload(marker)}, checkpoint_id=folder, no_dist=True)
    assert not marker.exists()
    state = {"w": torch.zeros(2), "lr": 0.1}
    with pytest.raises(
        CheckpointException, match=r"lr holds more than plain values \(it refers to exec\)"
    ):
        _no_dist_load(
            state, folder, storage_reader=CheckedReader(folder), planner=CheckedLoadPlanner()
        )
    assert not marker.exists()
    _no_dist_load(state, folder, storage_reader=CheckedReader(folder))  # DCP's own planner
    assert marker.exists()  # ran: what the checked planner prevents


def test_plain_values_of_a_dcp_shard_load_through_the_checked_planner(tmp_path):
    folder = tmp_path / "model_0"
    saved = {"w": torch.arange(3.0), "betas": (0.9, 0.99), "name": "adamw", "fused": None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(saved, checkpoint_id=folder, no_dist=True)
    state = {"w": torch.zeros(3), "betas": None, "name": None, "fused": 1}
    _no_dist_load(state, folder, storage_reader=CheckedReader(folder), planner=CheckedLoadPlanner())
    assert torch.equal(state["w"], saved["w"])
    assert (state["betas"], state["name"], state["fused"]) == ((0.9, 0.99), "adamw", None)


def _calls(name: str):
    for tree in SOURCES:
        for path in tree.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    func = node.func
                    called = (
                        func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    )
                    owner = getattr(getattr(func, "value", None), "id", "")
                    if f"{owner}.{called}" == name or called == name:
                        yield path, node


def test_every_torch_load_is_weights_only_and_every_yaml_read_is_safe():
    loose = [
        f"{path.name}:{node.lineno}"
        for path, node in _calls("torch.load")
        if not any(
            k.arg == "weights_only" and getattr(k.value, "value", None) is True
            for k in node.keywords
        )
    ]
    assert loose == []
    loaders = {
        kw.value.id for _, node in _calls("yaml.load") for kw in node.keywords if kw.arg == "Loader"
    }
    assert loaders == {"YamlLoader"} and issubclass(YamlLoader, yaml.SafeLoader)
    assert sum(1 for _ in _calls("yaml.load")) == sum(
        1 for _ in _calls("yaml.load") if any(k.arg == "Loader" for k in _[1].keywords)
    )
    assert [f"{p.name}:{n.lineno}" for p, n in _calls("pickle.load")] == []
    assert [f"{p.name}:{n.lineno}" for p, n in _calls("pickle.loads")] == []
