"""Whole-config checks: top-level typos are errors, options the strategy ignores are warnings,
and inspect-config shows both along with what the ranks would refuse."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from litegen.config import ConfigError, MainConfig
from litegen.config.checks import IgnoredOptionWarning, ignored_options, near_miss
from litegen_cli.app import app

ENTRY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_entry.py"


@pytest.mark.parametrize(
    ("key", "field"),
    [("max_step", "max_steps"), ("Max_Steps", "max_steps"), ("optimisation", "optimization"),
     ("init_form", "init_from"), ("run-time", "runtime"), ("LR", "lr"), ("trainers", "trainer")],
)  # fmt: skip
def test_a_top_level_typo_is_an_error_with_the_suggestion(key, field):
    with pytest.raises(ValueError, match=rf"field '{key}': unknown field, did you mean '{field}'"):
        MainConfig.from_dict({key: 4})


def test_typos_are_listed_with_the_other_problems_and_user_fields_stay():
    with pytest.raises(ValueError) as info:
        MainConfig(max_step=4, lr="fast")
    assert "field 'max_step'" in str(info.value) and "field 'lr'" in str(info.value)
    cfg = MainConfig.from_dict({"lrs": [1, 2], "emb": 3, "num_frames": 8, "warmup_lr": 1e-6})
    assert (cfg.lrs, cfg.emb, cfg.num_frames) == ([1, 2], 3, 8)
    assert near_miss("data", MainConfig.model_fields) is None


def test_a_subclass_field_is_matched_too():
    class VideoConfig(MainConfig):
        num_frames: int = 16

    with pytest.raises(ValueError, match="did you mean 'num_frames'"):
        VideoConfig.from_dict({"num_frame": 8})


def ignored(data: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = MainConfig.from_dict(data)
    lines = ignored_options(config)
    assert [str(w.message) for w in caught if w.category is IgnoredOptionWarning] == lines
    return lines


def test_options_the_strategy_ignores_warn_with_option_and_strategy():
    lines = ignored(
        {"optimization": {"precision": {"fsdp_mixed": {"param_dtype": "bf16"}}}}  # ddp
    )
    assert lines == [
        "optimization.precision.fsdp_mixed.param_dtype is set ('bf16'), but strategy 'ddp' "
        "ignores it; only fsdp1, fsdp2, hsdp read it. Remove it, or choose a strategy that "
        "reads it."
    ]
    fsdp2 = {"parallel": {"strategy": "fsdp2", "zero": {"bucket_size_mb": 8}}}
    [line] = ignored({"optimization": fsdp2})
    assert line.startswith(
        "optimization.parallel.zero.bucket_size_mb is set (8), but strategy 'fsdp2'"
    )
    assert ignored({"optimization": {"parallel": {"strategy": "fsdp1"}}, "ema": {"sharded": False}})
    # Read by the strategy, or left at the default: nothing to say.
    assert (
        ignored(
            {"optimization": {"parallel": {"strategy": "zero2", "zero": {"bucket_size_mb": 8}}}}
        )
        == []
    )
    assert ignored({"optimization": {"parallel": {"zero": {"bucket_size_mb": 64}}}}) == []


def test_profiles_count_for_the_general_options_and_are_checked_themselves():
    frozen_ddp = {"parallel": {"strategy": "ddp", "fsdp2": {"wrap_strategy": "manual"}}}
    optimization = {
        "parallel": {"strategy": "ddp", "fsdp2": {"reshard_after_forward": False}},
        "profiles": {"dit": {"parallel": {"strategy": "fsdp2"}}, "frozen": frozen_ddp},
    }
    # The dit profile (fsdp2) inherits the general fsdp2 options, so they are read.
    assert ignored({"optimization": optimization}) == [
        "optimization.profiles.frozen.parallel.fsdp2.wrap_strategy is set ('manual'), but "
        "strategy 'ddp' ignores it; only fsdp2, hsdp read it. Remove it, or choose a strategy "
        "that reads it."
    ]


def recipe(tmp_path: Path, **extra) -> Path:
    data = {
        "launch": {"entry": str(ENTRY), "nproc_per_node": 2},
        "results_dir": str(tmp_path / "results"),
        "runtime": {"device": "cpu"},
        "global_batch_size": 8,
        **extra,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def inspect(*args):
    return CliRunner().invoke(app, ["inspect-config", *map(str, args)], env={"COLUMNS": "300"})


def test_inspect_config_shows_typos_and_ignored_options(tmp_path):
    result = inspect(recipe(tmp_path, max_step=4))
    assert result.exit_code == 2
    assert "field 'max_step': unknown field, did you mean 'max_steps'?" in result.output
    result = inspect(recipe(tmp_path), "optimization.precision.fsdp_mixed.param_dtype=bf16")
    assert result.exit_code == 0, result.output
    assert "Warnings" in result.output
    assert (
        "optimization.precision.fsdp_mixed.param_dtype is set ('bf16'), but strategy 'ddp'"
        in result.output
    )


def test_inspect_config_reads_an_earlier_option_name_and_names_the_new_one(tmp_path):
    overrides = [
        "optimization.parallel.strategy=zero2",
        "optimization.parallel.zero1.bucket_size_mb=8",
    ]
    result = inspect(recipe(tmp_path), *overrides)
    assert result.exit_code == 0, result.output
    assert "optimization.parallel.zero1 is deprecated: use optimization.parallel.zero" in (
        result.output
    )
    # The earlier name is read: the same value under the new name shows no such note.
    renamed = inspect(recipe(tmp_path), overrides[0], "optimization.parallel.zero.bucket_size_mb=8")
    assert renamed.exit_code == 0 and "deprecated" not in renamed.output
    assert "bucket_size_mb: 8" in result.output and "bucket_size_mb: 8" in renamed.output


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["optimization.parallel.strategy=hsdp"], "'hsdp' replicates across nodes and needs launch.nnodes >= 2"),
        (["optimization.parallel.cp_size=3"], "field 'optimization.parallel.cp_size': sp_size 1 * cp_size 3 = 3 does not divide the world size"),
        (["optimization.parallel.cp_size=2", "optimization.parallel.strategy=fsdp1"], "fsdp1 has no sequence-parallel layout for ring attention"),
        (["optimization.parallel.strategy=zero2", "optimization.parallel.zero.parameter_sync=native"], "zero2 needs 'bucketed'"),
        (["optimization.parallel.strategy=fsdp1", "optimization.precision.fsdp_mixed.output_dtype=bf16"], "FSDP1 has no equivalent"),
        (["optimization.optimizer.backend=fused"], "'fused' needs CUDA parameters"),
        (["optimization.profiles.big.parallel.strategy=hsdp"], "field 'optimization.profiles.big.parallel.strategy': 'hsdp'"),
    ],
)  # fmt: skip
def test_inspect_config_reports_what_the_ranks_would_refuse(tmp_path, overrides, expected):
    result = inspect(recipe(tmp_path), *overrides)
    assert result.exit_code == 2, result.output
    assert expected in result.output


def test_checkpointing_of_no_block_warns_naming_the_field_and_the_fix(tmp_path, caplog):
    """The default selective_ratio (1.0) checkpoints nothing: the config says so when it loads,
    prepare names the model and its block count, and inspect-config lists it."""
    import torch

    import litegen
    from tests.unit.memory_nets import make_net

    on = {"memory": {"activation_checkpoint": {"enabled": True}}}
    with pytest.warns(IgnoredOptionWarning, match=r"activation_checkpoint\.selective_ratio: 0"):
        config = MainConfig.from_dict({"runtime": {"device": "cpu"}, "optimization": on})
    ac = config.optimization.memory.activation_checkpoint
    assert (ac.checkpointed_blocks(28), ac.checkpoints_nothing() is not None) == (0, True)
    gen = litegen.initialize(config)
    model = make_net()
    with caplog.at_level("WARNING", logger="litegen"):
        gen.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (line,) = [r.getMessage() for r in caplog.records if "checkpointing of 0 of" in r.getMessage()]
    assert "enabled: false" in line
    result = inspect(recipe(tmp_path), "optimization.memory.activation_checkpoint.enabled=true")
    assert result.exit_code == 0, result.output
    assert "so no block is checkpointed" in result.output
    # A ratio that checkpoints blocks, or checkpointing off, says nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredOptionWarning)
        half = {"memory": {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.5}}}
        config = MainConfig.from_dict({"optimization": half})
        MainConfig.from_dict({})
    assert config.optimization.memory.activation_checkpoint.checkpointed_blocks(28) == 14


COMBINATIONS = [
    (
        ["optimization.parallel.strategy=fsdp1", "optimization.parallel.sp_size=2"],
        "field 'optimization.parallel.sp_size': 2 does not work with "
        "optimization.parallel.strategy ('fsdp1'): fsdp1 has no sequence-parallel layout",
    ),
    (
        [
            "optimization.memory.activation_checkpoint.enabled=true",
            "optimization.memory.activation_checkpoint.policy=memory_budget",
        ],
        "field 'optimization.memory.activation_checkpoint.policy': 'memory_budget' does not "
        "work with optimization.compile.enabled (False): policy memory_budget is carried out",
    ),
    (
        [
            "optimization.memory.activation_checkpoint.enabled=true",
            "optimization.memory.activation_checkpoint.selective_ratio=auto",
        ],
        "with runtime.device ('cpu'): selective_ratio auto takes a fraction of the device's",
    ),
    (
        [
            "trainer.export_diffusers=true",
            "optimization.lora.rank=2",
            "optimization.lora.target_modules=[to_q]",
        ],
        "field 'trainer.export_diffusers': True does not work with optimization.lora (set)",
    ),
    (
        ["optimization.memory.block_swap.blocks_on_device=2"],
        "field 'optimization.memory.block_swap': set does not work with optimization.lora "
        "(None): block swap streams frozen base weights",
    ),
    (
        [
            "optimization.memory.block_swap.blocks_on_device=2",
            "optimization.parallel.strategy=fsdp2",
            "optimization.lora.target_modules=[to_q]",
        ],
        "field 'optimization.memory.block_swap': set does not work with "
        "optimization.parallel.strategy ('fsdp2'): block swap moves whole frozen weights",
    ),
    (
        [
            "optimization.lora.fp8_base=rowwise",
            "optimization.parallel.strategy=zero1",
            "optimization.lora.target_modules=[to_q]",
        ],
        "field 'optimization.lora.fp8_base': 'rowwise' does not work with "
        "optimization.parallel.strategy ('zero1'): fp8_base replaces whole frozen Linear",
    ),
    (
        [
            "optimization.parallel.strategy=fsdp2",
            "optimization.parallel.fsdp2.cpu_offload=true",
            "optimization.optimizer.backend=fused",
        ],
        "field 'optimization.parallel.fsdp2.cpu_offload': True does not work with "
        "optimization.optimizer.backend ('fused'): with cpu_offload the optimizer steps",
    ),
    (
        ["optimization.profiles.long.parallel.sp_size=2", "optimization.parallel.strategy=fsdp1"],
        "field 'optimization.profiles.long.parallel.sp_size': 2 does not work with "
        "optimization.profiles.long.parallel.strategy ('fsdp1')",
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), COMBINATIONS)
def test_settings_that_do_not_work_together_are_refused_before_the_ranks_start(
    tmp_path, overrides, expected
):
    """One line naming both fields and the fix, from inspect-config and launch (exit 2)."""
    path = recipe(tmp_path)
    result = inspect(path, *overrides)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()), result.output
    launched = CliRunner().invoke(app, ["launch", str(path), *overrides])
    assert launched.exit_code == 2, launched.output
    assert not (tmp_path / "results").exists()  # refused before any rank started


@pytest.mark.parametrize(
    ("memory", "other", "fix"),
    [
        ({"activation_offload": True}, "optimization.memory.activation_offload", "turn"),
        ({}, "optimization.compile.enabled", "set compile.enabled: false"),
    ],
)
def test_block_swap_refuses_other_saved_tensor_owners(memory, other, fix):
    optimization = {
        "lora": {"target_modules": ["to_q"]},
        "memory": {"block_swap": {"blocks_on_device": 1}} | memory,
        "compile": {"enabled": "compile" in other},
    }
    with pytest.raises(ConfigError) as caught:
        MainConfig.from_dict({"optimization": optimization})
    message = " ".join(str(caught.value).split())
    assert f"'optimization.memory.block_swap': set does not work with {other}" in message
    assert fix in message
    del optimization["memory"]["block_swap"]
    MainConfig.from_dict({"optimization": optimization})  # either alone is fine


def test_resume_reads_a_run_checkpoint_saved_with_earlier_option_names(tmp_path):
    # A run checkpoint's config.yaml from before the rename: the run continues, same options.
    import torch
    import torch.distributed.checkpoint as dcp

    from litegen.checkpoint.layout import COMPLETE, CONFIG, model_dir_name, rank_file
    from litegen_cli.resume import resume_recipe

    step = tmp_path / "run" / "step_2"
    for name in (COMPLETE, rank_file(0)):
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).touch()
    with warnings.catch_warnings():  # saved by this one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"weight": torch.zeros(2)}, checkpoint_id=step / model_dir_name(0))
    saved = {
        "results_dir": str(tmp_path / "run"),
        "runtime": {"device": "cpu"},
        "global_batch_size": 8,
        "optimization": {"parallel": {"strategy": "zero2", "zero1": {"bucket_size_mb": 8}}},
    }
    (step / CONFIG).write_text(yaml.safe_dump(saved))
    (step / "launch.yaml").write_text(yaml.safe_dump({"entry": str(ENTRY), "nproc_per_node": 2}))
    recipe, changes = resume_recipe(step, [])
    assert recipe.config.optimization.parallel.zero.bucket_size_mb == 8
    assert "optimization.parallel.zero1 is deprecated: use optimization.parallel.zero" in (
        recipe.warnings
    )
    assert changes == []
