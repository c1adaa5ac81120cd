"""LiteGen's typed configuration (Pydantic v2), importable without torch.

    from litegen.config import MainConfig

    config = MainConfig.load_yaml("recipe.yaml")
    config.optimization.parallel.strategy          # "ddp"

``MainConfig`` lives in :mod:`litegen.config.main`, the ``Config``/``Section`` bases and the
error format in :mod:`litegen.config.base`, the typed sections in :mod:`litegen.config.sections`
(runtime, parallelism, precision, ...), :mod:`litegen.config.memory` (memory savers),
:mod:`litegen.config.optimization` (the optimization section and its profiles) and
:mod:`litegen.config.training` (EMA, trainer); the table of parallel strategies is
:mod:`litegen.config.strategies`.
The spec's import path, ``litegen.utils.config``, re-exports this package.
"""

import warnings

from litegen.config.base import Config, ConfigError, Section
from litegen.config.main import MainConfig, YamlLoader
from litegen.config.memory import ActivationCheckpointConfig, MemoryConfig
from litegen.config.optimization import OptimizationConfig, OptimizationProfile
from litegen.config.sections import (
    CompileConfig,
    DistributedConfig,
    Dtype,
    ExperimentalConfig,
    FSDP2Config,
    FSDPMixedConfig,
    KernelsConfig,
    LoRAConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RuntimeConfig,
    ZeroConfig,
)
from litegen.config.training import EMAConfig, TrainerConfig

__all__ = [
    "ActivationCheckpointConfig",
    "CompileConfig",
    "Config",
    "ConfigError",
    "DistributedConfig",
    "Dtype",
    "EMAConfig",
    "ExperimentalConfig",
    "FSDP2Config",
    "FSDPMixedConfig",
    "KernelsConfig",
    "LoRAConfig",
    "MainConfig",
    "MemoryConfig",
    "OptimizationConfig",
    "OptimizationProfile",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RuntimeConfig",
    "Section",
    "TrainerConfig",
    "YamlLoader",
    "ZeroConfig",
]

# Earlier class names, named for one of the strategies that read the section.
_RENAMED = {"Zero1Config": "ZeroConfig", "FSDP2MixedConfig": "FSDPMixedConfig"}


def __getattr__(name: str):
    if name not in _RENAMED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new = _RENAMED[name]
    warnings.warn(
        f"{__name__}.{name} was renamed {__name__}.{new}; import that ({name} will be removed)",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[new]
