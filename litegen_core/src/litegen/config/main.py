"""``MainConfig``, the entry config: its fields, constructors (YAML, dict, OmegaConf) and exports.

    from litegen.config import MainConfig

    config = MainConfig.load_yaml("recipe.yaml")
    config.optimization.parallel.strategy          # "ddp"
    config.optimization_for("frozen")               # profile merged over the general settings
    config.my_model.depth                           # user extras become Config objects

Every constructor raises one ``ValueError`` (``ConfigError``) listing every bad field.
This module never imports torch, so the CLI can validate a recipe quickly.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import Field, field_validator, model_validator

from litegen.config.base import Config, ConfigError
from litegen.config.checks import (
    IgnoredOptionWarning,
    combination_problems,
    ignored_options,
    typo_problems,
)
from litegen.config.finetune import FinetuneConfig, move_deprecated_fields
from litegen.config.optimization import OptimizationConfig, value_at
from litegen.config.sections import PRECISION_PRESETS, RuntimeConfig
from litegen.config.training import EMAConfig, TrainerConfig


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` (no dot) as a float, as YAML 1.2 does."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


class MainConfig(Config):
    """Entry config of LiteGen: the fields below plus any user extras at the top level.

    >>> cfg = MainConfig(optimization={"parallel": {"strategy": "ddp"}}, num_frames=16)
    >>> cfg.optimization.parallel.strategy, cfg.num_frames, cfg.get_results_dir()
    ('ddp', 16, 'results/default_exp')
    """

    # experiment and file paths
    exp_name: str = "default_exp"
    results_dir: str | None = None
    checkpoint_dir: str | None = None
    init_from: str | None = None
    resume_from: str | None = None
    auto_resume: bool = False

    # sections defined by LiteGen (unknown keys rejected)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig)

    # algorithm settings, stored for training scripts
    lr: float = Field(1.0e-4, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)

    ema: EMAConfig = Field(default_factory=EMAConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    finetune: FinetuneConfig | None = None  # the fine-tuning road's (litegen.finetune)

    # training settings
    global_seed: int = Field(0, ge=0)
    max_steps: int = Field(1, ge=1)
    num_workers: int = Field(0, ge=0)
    pin_memory: bool = False
    global_batch_size: int = Field(1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_finetune_fields(cls, data: Any) -> Any:
        return move_deprecated_fields(data)

    @model_validator(mode="before")
    @classmethod
    def _precision_preset_trainer(cls, data: Any) -> Any:
        # The optimization section expands the rest of a preset; its trainer fields land here.
        preset = value_at(data, "optimization", "precision", "preset")
        if preset not in PRECISION_PRESETS:
            return data
        trainer = value_at(data, "trainer")
        trainer = dict(trainer) if isinstance(trainer, Mapping) else {}
        for key, value in PRECISION_PRESETS[preset]["trainer"].items():
            if trainer.get(key) is None:
                trainer[key] = value
        return {**data, "trainer": trainer}

    @field_validator("auto_resume")
    @classmethod
    def _one_resume_source(cls, value: bool, info: Any) -> bool:
        if value and info.data.get("resume_from"):
            raise ValueError(
                "auto_resume and resume_from are both set; set only one of them "
                "(resume_from for an explicit checkpoint, auto_resume for the latest one)"
            )
        return value

    @classmethod
    def whole_config_problems(cls, data: Any) -> list[tuple[str, str]]:
        """Top-level keys that are near misses of a field (``max_step``): typos, not extras."""
        return typo_problems(data, cls.model_fields)

    @model_validator(mode="after")
    def _warn_ignored_options(self) -> MainConfig:
        for line in ignored_options(self):
            warnings.warn(line, IgnoredOptionWarning, stacklevel=2)
        return self

    def combination_problems(self) -> list[tuple[str, str]]:
        """Settings that do not work together (``litegen.config.checks.UNSUPPORTED``)."""
        return combination_problems(self)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Validate a plain mapping.

        >>> cfg = MainConfig.from_dict({"optimization": {"precision": {"cast_model": "bf16"}}})
        >>> cfg.optimization.precision.cast_model
        'bf16'
        """
        if not isinstance(data, Mapping):
            raise ConfigError([("<root>", f"expected a mapping, got {type(data).__name__}")])
        return cls.model_validate(dict(data))

    @classmethod
    def load_yaml(cls, path: str | os.PathLike[str]) -> Self:
        """Read and validate a YAML recipe: ``MainConfig.load_yaml("recipe.yaml")``.

        An empty file gives the defaults; a missing file raises ``FileNotFoundError``.
        """
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"Config file not found: {str(file)!r}")
        try:
            data = yaml.load(file.read_text(encoding="utf-8"), Loader=YamlLoader)
        except yaml.YAMLError as exc:
            raise ValueError(f"Config file {str(file)!r} is not valid YAML: {exc}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(
                f"Config file {str(file)!r} must contain a YAML mapping at the top level, "
                f"got {type(data).__name__}"
            )
        return cls.from_dict(data)

    @classmethod
    def from_omegaconf(cls, cfg: Any) -> Self:
        """Validate a Hydra/OmegaConf ``DictConfig`` (interpolations resolved).

        >>> from omegaconf import OmegaConf
        >>> MainConfig.from_omegaconf(OmegaConf.create({"lr": 3e-4})).lr
        0.0003
        """
        try:
            from omegaconf import OmegaConf
        except ImportError:
            raise ImportError(
                "MainConfig.from_omegaconf needs the optional 'omegaconf' package: "
                "pip install omegaconf (or: uv sync --extra omegaconf --all-packages)"
            ) from None
        data = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
        return cls.from_dict(data)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ export and helpers

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        """YAML text of :meth:`to_dict`; also written to ``path`` when given.

        >>> "exp_name: default_exp" in MainConfig().to_yaml()
        True
        """
        text = yaml.safe_dump(
            self.to_dict(), sort_keys=False, allow_unicode=True, default_flow_style=False
        )
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def optimization_for(self, profile: str | None = None) -> OptimizationConfig:
        """Optimization settings of a profile (``None``: the general settings).

        >>> cfg = MainConfig(optimization={"profiles": {"frozen": {"kernels": {}}}})
        >>> cfg.optimization_for(None) is cfg.optimization
        True
        """
        return self.optimization.resolve(profile)

    def get_results_dir(self) -> str:
        """``results_dir``, or ``results/<exp_name>``: ``MainConfig().get_results_dir()``."""
        return self.results_dir or os.path.join("results", self.exp_name)

    def get_checkpoint_dir(self) -> str:
        """``checkpoint_dir``, or the results directory: ``cfg.get_checkpoint_dir()``."""
        return self.checkpoint_dir or self.get_results_dir()

    def with_absolute_paths(self, cwd: str | os.PathLike[str] | None = None) -> Self:
        """A copy whose paths are absolute (relative ones resolved against ``cwd``, default the
        current folder), so the run reads and writes the same files from any folder.

        ``results_dir`` is filled in (``results/<exp_name>`` when unset); the other path
        fields only when set, the ``finetune`` section's (pipeline, media folder, cache root)
        and the validation's condition files included.

        >>> MainConfig(results_dir="out").with_absolute_paths("/runs").results_dir
        '/runs/out'
        """
        base = Path(cwd) if cwd is not None else Path.cwd()

        def absolute(path: str | None) -> str | None:
            return None if path is None else str(base / Path(path).expanduser())

        validation_files = {
            name: [absolute(path) for path in paths]
            for name, paths in self.trainer.validation.conditions.items()
        }
        finetune = self.finetune
        if finetune is not None:
            data = finetune.data.model_copy(
                update={"folder": absolute(finetune.data.folder),
                        "cache_root": absolute(finetune.data.cache_root)}
            )  # fmt: skip
            pipeline = absolute(finetune.pipeline)
            finetune = finetune.model_copy(update={"pipeline": pipeline, "data": data})
        return self.model_copy(
            update={
                "finetune": finetune,
                "results_dir": absolute(self.get_results_dir()),
                "checkpoint_dir": absolute(self.checkpoint_dir),
                "init_from": absolute(self.init_from),
                "resume_from": absolute(self.resume_from),
                "ema": self.ema.model_copy(update={"resume_from": absolute(self.ema.resume_from)}),
                "trainer": self.trainer.model_copy(
                    update={
                        "resume_run": absolute(self.trainer.resume_run),
                        "validation": self.trainer.validation.model_copy(
                            update={"conditions": validation_files}
                        ),
                    }
                ),
            }
        )
