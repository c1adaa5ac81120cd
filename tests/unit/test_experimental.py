"""The experimental door: config switches features on, other torch releases turn them off."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import litegen
from litegen import experimental
from litegen.config import ExperimentalConfig, MainConfig
from litegen.experimental import TESTED_TORCH, Lab, available, torch_release
from litegen.experimental.switches import SWITCHES, is_on


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(experimental, "_warned", set())


def test_a_feature_steps_aside_with_one_warning_on_an_untested_torch(monkeypatch):
    monkeypatch.setitem(TESTED_TORCH, "master_adamw", ("0.1",))
    with pytest.warns(UserWarning, match=r"experimental.master_adamw is tested on torch 0.1"):
        assert not available("master_adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per feature, not per call
        assert not available("master_adamw")


def test_a_feature_runs_on_the_release_it_was_tested_on(monkeypatch):
    monkeypatch.setitem(TESTED_TORCH, "master_adamw", (torch_release(),))
    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    Lab(ExperimentalConfig(master_adamw=True)).configure_optimizer(optimizer)
    from litegen.experimental.master_adamw import one_pass_step

    assert optimizer._litegen_master_kernel is one_pass_step


def test_the_config_has_one_field_per_switch_all_off_by_default():
    names = [switch.name for switch in SWITCHES]
    assert len(set(names)) == len(names)
    assert set(ExperimentalConfig.model_fields) == set(names)
    defaults = ExperimentalConfig()
    assert [name for name in names if is_on(getattr(defaults, name))] == []


def test_each_switch_names_a_hook_target_that_exists():
    import importlib

    for switch in SWITCHES:
        module, attribute = switch.target.split(":")
        assert callable(getattr(importlib.import_module(module), attribute)), switch.name
        assert switch.tested_torch, switch.name
        if switch.hook == "module_swap":
            assert switch.swaps and switch.absent, switch.name


def test_compiled_blocks_get_a_context_only_for_a_switch_that_is_on(monkeypatch):
    monkeypatch.setitem(TESTED_TORCH, "persistent_rows", (torch_release(),))
    assert Lab(ExperimentalConfig()).block_contexts() == []
    (context,) = Lab(ExperimentalConfig(persistent_rows=2048)).block_contexts()
    with context():
        pass


def test_prepare_opens_the_door_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setitem(TESTED_TORCH, "master_adamw", ("0.1",))
    base = {"results_dir": str(tmp_path), "runtime": {"device": "cpu"}}
    gen = litegen.initialize(MainConfig.from_dict(base))
    model = nn.Linear(4, 4)
    _, optimizer = gen.prepare(model, torch.optim.AdamW(model.parameters()))
    assert not hasattr(optimizer, "_litegen_master_kernel")
    asked = {**base, "optimization": {"experimental": {"master_adamw": True}}}
    gen = litegen.initialize(MainConfig.from_dict(asked))
    model = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="master_adamw"):
        _, optimizer = gen.prepare(model, torch.optim.AdamW(model.parameters()))
    assert not hasattr(optimizer, "_litegen_master_kernel")  # stepped aside; training goes on


def test_the_docs_table_names_each_switch_and_the_torch_it_is_tested_on():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
    rows = {}
    for line in docs.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("torch "):
            switch = cells[0].strip("`").split(":")[0].split("`")[0]
            rows[switch] = tuple(v.strip() for v in cells[1].removeprefix("torch ").split(","))
    assert rows == TESTED_TORCH
    assert set(ExperimentalConfig.model_fields) == set(TESTED_TORCH)
