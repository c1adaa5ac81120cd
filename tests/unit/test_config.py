"""Unit tests of litegen.utils.config (no torch needed)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from litegen.utils.config import (
    Config,
    ConfigError,
    MainConfig,
)

SPEC_YAML = """\
exp_name: 'video_generation_exp1'
results_dir: 'path_to_the_results_dir'

# Checkpoint loading
init_from: 'path_to_the_init_model/model.pth'
auto_resume: False

# Runtime and performance optimization
runtime:
  device: cuda
  distributed:
    backend: nccl
    dist_url: env://
    dist_timeout: 1800
optimization:
  parallel:
    strategy: fsdp1
  memory:
    activation_checkpoint:
      enabled: true
      selective_ratio: 0
    activation_offload: true
"""


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def problems(exc_info: pytest.ExceptionInfo[ValueError]) -> list[str]:
    """The '  - field ...' lines of a config error."""
    return [line for line in str(exc_info.value).splitlines() if line.startswith("  - ")]


# --------------------------------------------------------------------------- spec examples


def test_spec_yaml_example(tmp_path: Path) -> None:
    cfg = MainConfig.load_yaml(write(tmp_path, SPEC_YAML))
    assert cfg.exp_name == "video_generation_exp1"
    assert cfg.results_dir == "path_to_the_results_dir"
    assert cfg.init_from == "path_to_the_init_model/model.pth"
    assert cfg.auto_resume is False
    assert cfg.runtime.device == "cuda"
    assert cfg.runtime.distributed.backend == "nccl"
    assert cfg.runtime.distributed.dist_url == "env://"
    assert cfg.runtime.distributed.dist_timeout == 1800
    assert cfg.optimization.parallel.strategy == "fsdp1"
    ac = cfg.optimization.memory.activation_checkpoint
    assert ac.enabled is True and ac.selective_ratio == 0
    assert cfg.optimization.memory.activation_offload is True
    assert cfg.get_checkpoint_dir() == "path_to_the_results_dir"


def test_from_dict_cast_model() -> None:
    cfg = MainConfig.from_dict({"optimization": {"precision": {"cast_model": "bf16"}}})
    assert cfg.optimization.precision.cast_model == "bf16"
    assert cfg.optimization.parallel.strategy == "ddp"


def test_keyword_construction() -> None:
    cfg = MainConfig(optimization={"parallel": {"strategy": "ddp"}}, lr=3e-4)
    assert cfg.optimization.parallel.strategy == "ddp"
    assert cfg.lr == 3e-4


def test_subclass_validates_own_fields(tmp_path: Path) -> None:
    class LatteConfig(MainConfig):
        num_frames: int = 16
        image_size: int = 256

    cfg = LatteConfig.load_yaml(write(tmp_path, "num_frames: 8\nextra_key: 1\n"))
    assert type(cfg) is LatteConfig
    assert (cfg.num_frames, cfg.image_size, cfg.extra_key) == (8, 256, 1)
    assert type(LatteConfig.from_dict({})) is LatteConfig
    with pytest.raises(ValueError) as exc_info:
        LatteConfig.from_dict({"num_frames": "many", "ema": {"decay": 2}})
    assert problems(exc_info) == [
        "  - field 'ema.decay': Input should be less than or equal to 1",
        "  - field 'num_frames': Input should be a valid integer, unable to parse string as an integer",
    ]
    with pytest.raises(ValueError, match="field 'image_size'"):
        LatteConfig(image_size=[1])


# --------------------------------------------------------------------------- errors


def test_error_format_lists_every_field() -> None:
    data = {"optimization": {"precision": {"cast_model": "int8"}}, "ema": {"decay": 1.5}}
    expected = (
        "Error to load config, found the following problems:\n"
        "  - field 'optimization.precision.cast_model': Input should be 'fp32', 'bf16' or 'fp16'\n"
        "  - field 'ema.decay': Input should be less than or equal to 1\n"
        "Please check your configuration."
    )
    for build in (
        lambda: MainConfig.from_dict(data),
        lambda: MainConfig(**data),
        lambda: MainConfig.model_validate(data),
    ):
        with pytest.raises(ValueError) as exc_info:
            build()
        assert not isinstance(exc_info.value, ValidationError)
        assert isinstance(exc_info.value, ConfigError)
        assert str(exc_info.value) == expected


def test_error_format_from_yaml_and_omegaconf(tmp_path: Path) -> None:
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf

    text = "optimization:\n  precision:\n    cast_model: int8\nema:\n  decay: 1.5\n"
    with pytest.raises(ValueError) as from_yaml:
        MainConfig.load_yaml(write(tmp_path, text))
    with pytest.raises(ValueError) as from_omega:
        MainConfig.from_omegaconf(OmegaConf.create(yaml.safe_load(text)))
    assert str(from_yaml.value) == str(from_omega.value)
    assert len(problems(from_yaml)) == 2


@pytest.mark.parametrize(
    ("data", "path", "hint"),
    [
        (
            {"optimization": {"memory": {"activaton_offload": True}}},
            "optimization.memory.activaton_offload",
            "activation_offload",
        ),
        ({"runtime": {"distributed": {"backnd": "gloo"}}}, "runtime.distributed.backnd", "backend"),
        ({"ema": {"decey": 0.9}}, "ema.decey", "decay"),
        ({"trainer": {"grad_acum_steps": 2}}, "trainer.grad_acum_steps", "grad_accum_steps"),
        ({"optimization": {"paralel": {}}}, "optimization.paralel", "parallel"),
    ],
)
def test_unknown_nested_key_did_you_mean(data: dict, path: str, hint: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        MainConfig.from_dict(data)
    (line,) = problems(exc_info)
    assert line.startswith(f"  - field '{path}': Extra inputs are not permitted")
    assert line.endswith(f"did you mean '{hint}'?")


def test_unknown_nested_key_without_close_match() -> None:
    with pytest.raises(ValueError) as exc_info:
        MainConfig.from_dict({"ema": {"zzz": 1}})
    assert problems(exc_info) == ["  - field 'ema.zzz': Extra inputs are not permitted"]


def test_union_errors_merged_into_one_line() -> None:
    with pytest.raises(ValueError) as exc_info:
        MainConfig.from_dict(
            {"optimization": {"parallel": {"fsdp2": {"reshard_after_forward": "x"}}}}
        )
    (line,) = problems(exc_info)
    assert line.startswith("  - field 'optimization.parallel.fsdp2.reshard_after_forward': ")


@pytest.mark.parametrize(
    ("data", "path"),
    [
        (
            {"optimization": {"memory": {"activation_checkpoint": {"selective_ratio": 1.5}}}},
            "optimization.memory.activation_checkpoint.selective_ratio",
        ),
        (
            {"optimization": {"memory": {"activation_checkpoint": {"selective_ratio": -0.1}}}},
            "optimization.memory.activation_checkpoint.selective_ratio",
        ),
        ({"ema": {"decay": -0.1}}, "ema.decay"),
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"max_steps": 0}, "max_steps"),
        ({"optimization": {"parallel": {"strategy": "zero3"}}}, "optimization.parallel.strategy"),
        ({"optimization": {"parallel": {"sp_size": 0}}}, "optimization.parallel.sp_size"),
        (
            {"optimization": {"precision": {"fsdp_mixed": {"param_dtype": "fp64"}}}},
            "optimization.precision.fsdp_mixed.param_dtype",
        ),
        ({"optimization": {"optimizer": {"backend": "apex"}}}, "optimization.optimizer.backend"),
        ({"runtime": {"device": "tpu"}}, "runtime.device"),
        ({"trainer": {"grad_accum_steps": 0}}, "trainer.grad_accum_steps"),
        ({"trainer": {"max_grad_norm": 0}}, "trainer.max_grad_norm"),
        ({"trainer": {"log_every": 0}}, "trainer.log_every"),
        ({"trainer": {"checkpoint_every": -1}}, "trainer.checkpoint_every"),
        ({"trainer": {"keep_last": 0}}, "trainer.keep_last"),
        ({"trainer": {"on_nan": "ignore"}}, "trainer.on_nan"),
        ({"trainer": {"autocast": "fp32"}}, "trainer.autocast"),
        ({"optimization": 3}, "optimization"),
    ],
)
def test_ranges_and_choices_rejected(data: dict, path: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        MainConfig.from_dict(data)
    (line,) = problems(exc_info)
    assert line.startswith(f"  - field '{path}': ")


def test_auto_resume_with_resume_from_rejected() -> None:
    with pytest.raises(ValueError, match="set only one") as exc_info:
        MainConfig(auto_resume=True, resume_from="ckpt/model_10.pth")
    assert problems(exc_info)[0].startswith("  - field 'auto_resume': ")
    assert MainConfig(auto_resume=True).auto_resume is True
    assert MainConfig(resume_from="m.pth").resume_from == "m.pth"


def test_missing_yaml_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "recipe.yaml"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        MainConfig.load_yaml(missing)


def test_yaml_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must contain a YAML mapping"):
        MainConfig.load_yaml(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ValueError, match="not valid YAML"):
        MainConfig.load_yaml(write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ValueError, match="expected a mapping"):
        MainConfig.from_dict([1, 2])  # type: ignore[arg-type]


def test_empty_yaml_gives_defaults(tmp_path: Path) -> None:
    assert MainConfig.load_yaml(write(tmp_path, "# nothing\n")) == MainConfig()


def test_yaml_scientific_floats(tmp_path: Path) -> None:
    cfg = MainConfig.load_yaml(write(tmp_path, "lr: 1e-4\nwarmup_lr: 5e-6\n"))
    assert cfg.lr == 1e-4
    assert cfg.warmup_lr == 5e-6  # an extra: not a string thanks to the YAML 1.2 float rule


# --------------------------------------------------------------------------- Config behaviour


def test_extras_kept_and_converted() -> None:
    cfg = MainConfig.from_dict(
        {
            "model": {"name": "DiT-XL/2", "blocks": {"depth": 28}},
            "datasets": [{"path": "a", "weight": 1}, {"path": "b"}, 3, [{"x": 1}]],
            "lr_schedule": {1: 0.1, 2: 0.01},
        }
    )
    assert isinstance(cfg.model, Config)
    assert cfg.model.blocks.depth == 28
    assert cfg["model"]["name"] == "DiT-XL/2"
    assert isinstance(cfg.datasets[0], Config)
    assert cfg.datasets[1].path == "b"
    assert cfg.datasets[2] == 3
    assert cfg.datasets[3][0].x == 1
    assert type(cfg.lr_schedule) is dict
    assert cfg.lr_schedule == {1: 0.1, 2: 0.01}


def test_mapping_style_access() -> None:
    cfg = MainConfig(user={"a": 1})
    assert cfg["lr"] == 1e-4 and cfg["user"].a == 1
    assert cfg.get("lr") == 1e-4 and cfg.get("missing", 7) == 7 and cfg.get("missing") is None
    assert "user" in cfg and "lr" in cfg and "missing" not in cfg
    assert "a" in cfg.user and cfg.user.get("b", 2) == 2
    with pytest.raises(KeyError):
        cfg["missing"]
    with pytest.raises(AttributeError):
        _ = cfg.missing
    assert not hasattr(cfg, "missing") and hasattr(cfg, "user")
    assert not hasattr(cfg.optimization, "missing")
    assert list(cfg.keys())[:2] == ["exp_name", "results_dir"] and "user" in list(cfg.keys())
    assert dict(cfg.user.items()) == {"a": 1}
    cfg["note"] = "hi"
    assert cfg.note == "hi"
    assert Config(a={"b": 1}).a.b == 1


# --------------------------------------------------------------------------- export

# Per-model profiles, also exercised in test_config_sections.py.
PROFILES = {
    "optimization": {
        "parallel": {"strategy": "fsdp2"},
        "precision": {"cast_model": "bf16"},
        "memory": {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.3}},
        "profiles": {
            "frozen": {
                "parallel": {"strategy": "ddp"},
                "memory": {"activation_checkpoint": {"enabled": False}},
            },
            "fp32": {"precision": {"cast_model": None}},
            "empty": {},
        },
    }
}


def test_to_dict_round_trip() -> None:
    data = {
        **PROFILES,
        "exp_name": "rt",
        "runtime": {"device": "cpu"},
        "trainer": {"keep_last": 2},
        "model": {"depth": 28, "heads": [{"n": 1}, {"n": 2}]},
        "lr_schedule": {1: 0.1, 2: 0.01},
        "tags": ["a", "b"],
    }
    cfg = MainConfig.from_dict(data)
    plain = cfg.to_dict()
    assert plain["model"] == {"depth": 28, "heads": [{"n": 1}, {"n": 2}]}
    assert plain["optimization"]["profiles"]["fp32"] == {"precision": {"cast_model": None}}
    assert plain["lr_schedule"] == {1: 0.1, 2: 0.01}
    assert MainConfig.from_dict(plain) == cfg
    assert MainConfig.from_dict(plain).optimization_for("frozen") == cfg.optimization_for("frozen")


def test_to_yaml_round_trip(tmp_path: Path) -> None:
    cfg = MainConfig.from_dict({**PROFILES, "model": {"depth": 28}, "lr_schedule": {1: 0.1}})
    text = cfg.to_yaml()
    assert yaml.safe_load(text) == cfg.to_dict()
    path = tmp_path / "saved.yaml"
    assert cfg.to_yaml(path) == text
    assert MainConfig.load_yaml(path) == cfg


def test_spec_yaml_round_trip(tmp_path: Path) -> None:
    cfg = MainConfig.load_yaml(write(tmp_path, SPEC_YAML))
    assert MainConfig.load_yaml(write(tmp_path, cfg.to_yaml(), "again.yaml")) == cfg


# --------------------------------------------------------------------------- omegaconf


def test_from_omegaconf_resolves_interpolations() -> None:
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf

    oc = OmegaConf.create(
        {
            "exp_name": "oc",
            "results_dir": "runs/${exp_name}",
            "optimization": {"parallel": {"strategy": "zero1"}},
            "model": {"depth": 12},
        }
    )
    cfg = MainConfig.from_omegaconf(oc)
    assert cfg.results_dir == "runs/oc"
    assert cfg.optimization.parallel.strategy == "zero1"
    assert cfg.model.depth == 12


def test_from_omegaconf_without_omegaconf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "omegaconf", None)
    with pytest.raises(ImportError) as exc_info:
        MainConfig.from_omegaconf({})
    assert "pip install omegaconf" in str(exc_info.value)
    assert "uv sync --extra omegaconf" in str(exc_info.value)


# --------------------------------------------------------------------------- import cost


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, litegen.utils.config as c; "
        "c.MainConfig.from_dict({'optimization': {'parallel': {'strategy': 'fsdp2'}}}); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
