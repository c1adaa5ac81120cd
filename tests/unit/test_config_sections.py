"""Unit tests of MainConfig's sections: every field's default, and per-model profiles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from litegen.config.base import DeprecatedFieldWarning
from litegen.utils.config import MainConfig, OptimizationConfig, TrainerConfig
from tests.unit.test_config import PROFILES, problems

# --------------------------------------------------------------------------- defaults


def test_defaults_of_every_field() -> None:
    cfg = MainConfig()
    assert cfg.to_dict() == {
        "exp_name": "default_exp",
        "results_dir": None,
        "checkpoint_dir": None,
        "init_from": None,
        "resume_from": None,
        "auto_resume": False,
        "runtime": {
            "device": None,
            "distributed": {"backend": None, "dist_url": "env://", "dist_timeout": 1800},
        },
        "optimization": {
            "parallel": {
                "strategy": "ddp",
                "zero": {
                    "bucket_size_mb": 64,
                    "parameter_sync": "bucketed",
                    "overlap_comm": True,
                    "release_grad_buffer": True,
                    "normalize_parameter_layout": False,
                },
                "fsdp2": {
                    "wrap_strategy": "repeated",
                    "wrap_paths": [],
                    "wrap_class_names": [],
                    "min_num_params": 1,
                    "exclude_paths": [],
                    "reshard_after_forward": None,
                    "root_reshard_after_forward": None,
                    "last_unit_reshard_after_forward": None,
                    "allow_empty_param_unit_sharding": False,
                    "cpu_offload": False,
                },
                "sp_size": 1,
                "cp_size": 1,
            },
            "precision": {
                "preset": None,
                "cast_model": None,
                "cast_exclude_paths": [],
                "fsdp_mixed": {
                    "param_dtype": None,
                    "reduce_dtype": None,
                    "output_dtype": None,
                    "cast_forward_inputs": True,
                },
                "allow_tf32": True,
                "fp8_linear": None,
            },
            "optimizer": {"fp32_master_weights": False, "backend": None},
            "compile": {
                "enabled": False,
                "mode": "default",
                "dynamic": False,
                "options": {},
            },
            "memory": {
                "activation_checkpoint": {
                    "enabled": False,
                    "selective_ratio": 1.0,
                    "memory_budget_gib": None,
                    "memory_budget_fraction": 0.9,
                    "target_paths": [],
                    "policy": "block",
                    "memory_budget": 0.5,
                    "inside_compile": True,
                },
                "activation_offload": False,
                "mlp_chunk_tokens": None,
                "block_swap": None,
            },
            "kernels": {"fused_layernorm": False, "attention_backend": "auto"},
            "experimental": {
                "persistent_rows": None,
                "fused_gelu_mlp": False,
                "master_adamw": False,
                "fused_wan_attention": False,
            },
            "lora": None,
            "profiles": {},
        },
        "lr": 1.0e-4,
        "weight_decay": 0.0,
        "ema": {"enable": False, "sharded": True, "decay": 0.9999, "resume_from": None},
        "trainer": {
            "grad_accum_steps": 1,
            "max_grad_norm": None,
            "log_every": 10,
            "checkpoint_every": 0,
            "save_final": True,
            "export_diffusers": False,
            "export_ema": True,
            "keep_last": None,
            "async_checkpoint": False,
            "resume_run": None,
            "on_nan": "abort",
            "autocast": None,
            "peak_tflops": None,
            "tokens_per_sample": None,
            "sample_every": 0,
            "validation": {
                "prompts": [],
                "steps": None,
                "guidance": None,
                "height": None,
                "width": None,
                "frames": None,
                "seed": 0,
                "conditions": {},
            },
            "validate_every": 0,
            "loggers": ["jsonl"],
            "wandb": {"project": None, "mode": "offline"},
            "profile": None,
        },
        "finetune": None,
        "global_seed": 0,
        "max_steps": 1,
        "num_workers": 0,
        "pin_memory": False,
        "global_batch_size": 1,
    }


def test_default_lists_are_not_shared() -> None:
    a, b = MainConfig(), MainConfig()
    a.optimization.parallel.fsdp2.wrap_paths.append("x")
    assert b.optimization.parallel.fsdp2.wrap_paths == []


def test_results_and_checkpoint_dirs() -> None:
    assert MainConfig(exp_name="e1").get_results_dir() == str(Path("results") / "e1")
    assert MainConfig(exp_name="e1").get_checkpoint_dir() == str(Path("results") / "e1")
    cfg = MainConfig(results_dir="out")
    assert (cfg.get_results_dir(), cfg.get_checkpoint_dir()) == ("out", "out")
    cfg = MainConfig(results_dir="out", checkpoint_dir="ckpt")
    assert cfg.get_checkpoint_dir() == "ckpt"


def test_trainer_section() -> None:
    cfg = MainConfig(
        trainer={
            "grad_accum_steps": 4,
            "max_grad_norm": 1.0,
            "checkpoint_every": 500,
            "keep_last": 3,
            "on_nan": "skip",
            "autocast": "bf16",
        }
    )
    t = cfg.trainer
    assert isinstance(t, TrainerConfig)
    assert (t.grad_accum_steps, t.max_grad_norm, t.checkpoint_every) == (4, 1.0, 500)
    assert (t.keep_last, t.on_nan, t.autocast, t.save_final, t.log_every) == (
        3,
        "skip",
        "bf16",
        True,
        10,
    )


# --------------------------------------------------------------------------- profiles


def test_profiles_inherit_general_settings() -> None:
    cfg = MainConfig.from_dict(PROFILES)
    general = cfg.optimization_for(None)
    assert general is cfg.optimization

    frozen = cfg.optimization_for("frozen")
    assert isinstance(frozen, OptimizationConfig)
    assert frozen.parallel.strategy == "ddp"
    assert frozen.precision.cast_model == "bf16"  # inherited
    assert frozen.memory.activation_checkpoint.enabled is False
    assert frozen.memory.activation_checkpoint.selective_ratio == 0.3  # inherited sibling
    assert frozen.profiles == {}

    assert cfg.optimization_for("fp32").precision.cast_model is None  # explicit null overrides
    assert cfg.optimization_for("fp32").parallel.strategy == "fsdp2"
    empty = cfg.optimization_for("empty")
    assert empty.to_dict() == {**cfg.optimization.to_dict(), "profiles": {}}
    # the general section is untouched by resolving profiles
    assert cfg.optimization.parallel.strategy == "fsdp2"


def test_unknown_profile_name() -> None:
    cfg = MainConfig.from_dict(PROFILES)
    with pytest.raises(ValueError, match="'frozen', 'fp32', 'empty'"):
        cfg.optimization_for("missing")
    with pytest.raises(ValueError, match="none defined"):
        MainConfig().optimization_for("frozen")


def test_bad_profile_fields_reported_at_load_time() -> None:
    data = {
        "optimization": {
            "profiles": {
                "frozen": {
                    "memory": {
                        "activation_offload": "maybe",
                        "activation_checkpoint": {"enabled": None},
                    },
                    "parallel": {"stratgy": "ddp"},
                }
            }
        },
        "ema": {"decay": 2},
    }
    with pytest.raises(ValueError) as exc_info:
        MainConfig.from_dict(data)
    lines = problems(exc_info)
    assert (
        "  - field 'optimization.profiles.frozen.memory.activation_offload': Input should be a valid boolean, unable to interpret input"
        in lines
    )
    assert any(
        x.startswith(
            "  - field 'optimization.profiles.frozen.memory.activation_checkpoint.enabled': "
        )
        for x in lines
    )
    assert any(
        x.startswith("  - field 'optimization.profiles.frozen.parallel.stratgy': ")
        and x.endswith("did you mean 'strategy'?")
        for x in lines
    )
    assert any(x.startswith("  - field 'ema.decay': ") for x in lines)
    with pytest.raises(
        ValueError,
        match=re.escape("optimization.profiles.x.memory.activation_checkpoint.selective_ratio"),
    ):
        MainConfig(
            optimization={
                "profiles": {"x": {"memory": {"activation_checkpoint": {"selective_ratio": 2}}}}
            }
        )
    with pytest.raises(ValueError, match=re.escape("field 'optimization.profiles.x.profiles'")):
        MainConfig(optimization={"profiles": {"x": {"profiles": {}}}})


def test_rules_across_fields_hold_for_merged_profiles_at_load_time() -> None:
    # persistent_rows needs compile.enabled, which the profile inherits from the general settings.
    general = {"compile": {"enabled": True}}
    profile = {"frozen": {"experimental": {"persistent_rows": 2048}}}
    cfg = MainConfig.from_dict({"optimization": {**general, "profiles": profile}})
    assert cfg.optimization_for("frozen").experimental.persistent_rows == 2048
    with pytest.raises(ValueError) as exc_info:
        MainConfig.from_dict({"optimization": {"profiles": profile}})
    (line,) = problems(exc_info)
    assert "optimization.profiles.frozen.experimental: persistent_rows" in line
    assert "set optimization.compile.enabled: true" in line


def test_tensor_and_pipeline_degrees_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="tp_size: LiteGen has no tensor or pipeline parallelism"):
        MainConfig(optimization={"parallel": {"tp_size": 1}})


def test_the_bf16_mixed_preset_sets_its_fields_unless_written() -> None:
    cfg = MainConfig(optimization={"precision": {"preset": "bf16-mixed"}})
    assert cfg.optimization.precision.cast_model == "bf16"
    assert cfg.optimization.optimizer.fp32_master_weights is True
    assert cfg.trainer.autocast == "bf16"
    written = MainConfig(
        optimization={
            "precision": {"preset": "bf16-mixed", "cast_model": "fp32"},
            "optimizer": {"fp32_master_weights": False},
        },
        trainer={"autocast": "fp16"},
    )
    assert written.optimization.precision.cast_model == "fp32"
    assert written.optimization.optimizer.fp32_master_weights is False
    assert written.trainer.autocast == "fp16"
    profiled = MainConfig(optimization={"profiles": {"p": {"precision": {"preset": "bf16-mixed"}}}})
    assert profiled.optimization_for("p").precision.cast_model == "bf16"
    assert profiled.optimization_for(None).precision.cast_model is None
    with pytest.raises(ValueError, match=r"optimization\.precision\.preset"):
        MainConfig(optimization={"precision": {"preset": "bf16"}})


def test_earlier_option_names_load_into_the_new_ones_with_a_warning(tmp_path: Path) -> None:
    # A recipe or a run's saved config written before the rename: zero1 and fsdp2_mixed.
    saved = tmp_path / "config.yaml"
    saved.write_text(
        "optimization:\n"
        "  parallel:\n"
        "    strategy: zero2\n"
        "    zero1: {bucket_size_mb: 8, overlap_comm: false}\n"
        "  precision:\n"
        "    fsdp2_mixed: {param_dtype: bf16}\n"
        "  profiles:\n"
        "    frozen:\n"
        "      parallel: {zero1: {bucket_size_mb: 16}}\n"
    )
    with pytest.warns(DeprecatedFieldWarning) as caught:
        cfg = MainConfig.load_yaml(saved)
    assert sorted(str(w.message) for w in caught if w.category is DeprecatedFieldWarning) == [
        "optimization.parallel.zero1 is deprecated: use optimization.parallel.zero",
        "optimization.precision.fsdp2_mixed is deprecated: use optimization.precision.fsdp_mixed",
        "optimization.profiles.frozen.parallel.zero1 is deprecated: "
        "use optimization.profiles.frozen.parallel.zero",
    ]
    renamed = MainConfig(
        optimization={
            "parallel": {"strategy": "zero2", "zero": {"bucket_size_mb": 8, "overlap_comm": False}},
            "precision": {"fsdp_mixed": {"param_dtype": "bf16"}},
            "profiles": {"frozen": {"parallel": {"zero": {"bucket_size_mb": 16}}}},
        }
    )
    assert cfg.to_dict() == renamed.to_dict()
    assert cfg.optimization.parallel.zero.bucket_size_mb == 8
    assert cfg.optimization.precision.fsdp_mixed.param_dtype == "bf16"
    assert cfg.optimization.resolve("frozen").parallel.zero.bucket_size_mb == 16
    # An override in the earlier name over a saved config in the new one: the override wins.
    data = renamed.to_dict()
    data["optimization"]["parallel"]["zero1"] = {"bucket_size_mb": 32}
    with pytest.warns(DeprecatedFieldWarning):
        over = MainConfig(**data).optimization.parallel.zero
    assert (over.bucket_size_mb, over.overlap_comm) == (32, False)


def test_earlier_option_class_names_still_import() -> None:
    import litegen.config

    with pytest.warns(DeprecationWarning, match="litegen.config.ZeroConfig"):
        assert litegen.config.Zero1Config is litegen.config.ZeroConfig
    with pytest.warns(DeprecationWarning, match="litegen.config.FSDPMixedConfig"):
        assert litegen.config.FSDP2MixedConfig is litegen.config.FSDPMixedConfig
