"""The typed sections of ``MainConfig`` for the runtime and the parts of ``optimization``:
parallelism, precision, the optimizer, compile, kernels, the lab and LoRA. The memory section
is :mod:`litegen.config.memory`'s, the optimization section that holds them all
:mod:`litegen.config.optimization`'s.

Import the public names from :mod:`litegen.config`; this module only exists to keep
each file readable. It must never import torch (the CLI imports it for fast validation).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from litegen.config.base import DeprecatedFieldWarning, Section
from litegen.config.strategies import DEFAULT_STRATEGY, RENAMED_OPTIONS, STRATEGIES

Dtype = Literal["fp32", "bf16", "fp16"]
"""Names accepted by every dtype field."""

StrategyName = Literal[tuple(STRATEGIES)]  # type: ignore[valid-type]
"""The parallel strategies of the table (:data:`litegen.config.strategies.TABLE`)."""


# --------------------------------------------------------------------------- runtime


class DistributedConfig(Section):
    """Process-group settings (``runtime.distributed``)."""

    backend: str | None = Field(None, description="None: nccl on CUDA, gloo on CPU")
    dist_url: str = "env://"
    dist_timeout: int = Field(1800, ge=1, description="seconds")


class RuntimeConfig(Section):
    """Device and distributed environment (``runtime``)."""

    device: Literal["cuda", "cpu", "npu"] | None = Field(
        None, description="None: cuda when available, otherwise cpu"
    )
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)


# --------------------------------------------------------------------------- optimization


class ZeroConfig(Section):
    """Options of the ZeRO strategies, ``zero1`` and ``zero2`` (``optimization.parallel.zero``)."""

    bucket_size_mb: int = Field(64, ge=1)
    parameter_sync: Literal["bucketed", "native", "native_bucket_view"] = "bucketed"
    overlap_comm: bool = True
    release_grad_buffer: bool = True
    normalize_parameter_layout: bool = False


class FSDP2Config(Section):
    """Options of the ``fsdp2``/``hsdp`` strategies (``optimization.parallel.fsdp2``)."""

    wrap_strategy: Literal["manual", "repeated", "size_based", "class_based"] = "repeated"
    wrap_paths: list[str] = Field(default_factory=list)
    wrap_class_names: list[str] = Field(default_factory=list)
    min_num_params: int = Field(1, ge=1)
    exclude_paths: list[str] = Field(default_factory=list)
    reshard_after_forward: bool | int | None = None
    root_reshard_after_forward: bool | int | None = None
    last_unit_reshard_after_forward: bool | int | None = None
    allow_empty_param_unit_sharding: bool = False
    cpu_offload: bool = False
    """Keep the sharded parameters, their gradients and the optimizer state in host memory
    (FSDP2's ``CPUOffloadPolicy``, pinned on CUDA): each unit is copied to the device for its
    forward and backward, and the optimizer steps on the host. Works on one rank too."""


class ParallelConfig(Section):
    """Parallel strategy and degrees (``optimization.parallel``)."""

    strategy: StrategyName = DEFAULT_STRATEGY
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    fsdp2: FSDP2Config = Field(default_factory=FSDP2Config)
    sp_size: int = Field(1, ge=1)
    cp_size: int = Field(1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _no_tensor_or_pipeline_parallelism(cls, data: Any) -> Any:
        named = [key for key in ("tp_size", "pp_size") if isinstance(data, Mapping) and key in data]
        if named:
            raise ValueError(
                f"{' and '.join(named)}: LiteGen has no tensor or pipeline parallelism; remove "
                f"{'them' if len(named) > 1 else 'it'} (data and sequence parallelism: strategy "
                "and sp_size)."
            )
        return data


class FSDPMixedConfig(Section):
    """Mixed precision of the FSDP strategies, ``fsdp1``, ``fsdp2`` and ``hsdp``
    (``optimization.precision.fsdp_mixed``): FSDP2's ``MixedPrecisionPolicy``, which ``fsdp1``
    maps onto FSDP1's ``MixedPrecision``."""

    param_dtype: Dtype | None = None
    reduce_dtype: Dtype | None = None
    output_dtype: Dtype | None = None
    cast_forward_inputs: bool = True


PRECISION_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # Parameters stored (and gathered, and reduced) in bf16, stepped through FP32 masters; the
    # forward runs under bf16 autocast.
    "bf16-mixed": {
        "optimization": {
            "precision": {"cast_model": "bf16"},
            "optimizer": {"fp32_master_weights": True},
        },
        "trainer": {"autocast": "bf16"},
    },
}
"""``optimization.precision.preset`` -> top-level section -> the fields it sets there (unless
set explicitly): the optimization section expands its part, ``MainConfig`` the trainer's."""


class PrecisionConfig(Section):
    """Model dtype cast and mixed precision (``optimization.precision``)."""

    preset: Literal[tuple(PRECISION_PRESETS)] | None = None  # type: ignore[valid-type]
    """A named combination of the fields below, ``optimizer.fp32_master_weights`` and
    ``trainer.autocast``; fields written in the config win over it."""
    cast_model: Dtype | None = None
    cast_exclude_paths: list[str] = Field(default_factory=list)
    fsdp_mixed: FSDPMixedConfig = Field(default_factory=FSDPMixedConfig)
    allow_tf32: bool = True
    fp8_linear: Literal["tensorwise", "rowwise"] | None = None
    """FP8 matmuls in the trained model's ``nn.Linear`` layers through torchao's float8 recipes
    (``litegen.precision.fp8_training``; CUDA with compute capability 8.9+ and the ``torchao`` extra);
    elsewhere it steps aside with one warning. ``null``: off."""


def rename_deprecated_options(optimization: Any, where: str = "optimization") -> Any:
    """The raw ``optimization`` section ``optimization`` (at path ``where``) with the earlier
    names of :data:`RENAMED_OPTIONS` renamed, a warning each. Where both names are written (an
    override with the old one over a saved config), the old name's fields win: the user wrote them.

    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     out = rename_deprecated_options({"parallel": {"zero1": {"bucket_size_mb": 8}}})
    >>> out, str(caught[0].message)
    ({'parallel': {'zero': {'bucket_size_mb': 8}}}, 'optimization.parallel.zero1 is deprecated: use optimization.parallel.zero')
    """
    if not isinstance(optimization, Mapping):
        return optimization
    out = dict(optimization)
    for section, renames in RENAMED_OPTIONS.items():
        values = out.get(section)
        if not isinstance(values, Mapping) or not renames.keys() & values.keys():
            continue
        values = dict(values)
        for old, new in renames.items():
            if old not in values:
                continue
            message = f"{where}.{section}.{old} is deprecated: use {where}.{section}.{new}"
            warnings.warn(message, DeprecatedFieldWarning, stacklevel=2)
            written, current = values.pop(old), values.get(new)
            if isinstance(written, Mapping) and isinstance(current, Mapping):
                written = {**current, **written}
            values[new] = written
        out[section] = values
    return out


class OptimizerConfig(Section):
    """Optimizer wrapping options (``optimization.optimizer``)."""

    fp32_master_weights: bool = False
    backend: Literal["single_tensor", "foreach", "fused"] | None = None
    """``None`` keeps the optimizer's own ``foreach``/``fused`` flags (``AdamW(fused=True)`` stays
    fused); a value overrides them. ``None`` rather than a default value, so that a config written
    out and read back (the resolved recipe of ``litegen launch``, a checkpoint's config) means
    the same."""


class CompileConfig(Section):
    """Regional ``torch.compile`` of the repeated blocks (``optimization.compile``).

    ``dynamic: null`` bounds recompiles for variable resolutions (see docs/performance.md).
    """

    enabled: bool | Literal["auto"] = False
    """``auto``: compile on CUDA, stay eager on the CPU (where inductor's C++ build of a small
    model costs more than it gains) and under block swap (which compile cannot follow)."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "default"
    )
    dynamic: bool | None = False
    options: dict[str, Any] = Field(default_factory=dict)
    """Inductor options passed as ``torch.compile(options=...)``, e.g.
    ``coordinate_descent_tuning: true``; torch allows them only with ``mode: default``."""


class KernelsConfig(Section):
    """Kernel replacements (``optimization.kernels``)."""

    fused_layernorm: bool = False
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math", "flash_attn"] = "auto"
    """Scaled-dot-product-attention kernel for the run (see ``litegen.kernels.attention``)."""


class ExperimentalConfig(Section):
    """Kernels that patch private or beta APIs (``optimization.experimental``), all off.

    Each runs only on the torch release it was tested on and otherwise steps aside with a
    one-line warning (``litegen.experimental``). One field per row of
    ``litegen.experimental.switches.SWITCHES``, off by default (tests/unit/test_experimental.py).
    """

    persistent_rows: int | None = Field(None, ge=1)
    """Forward row reductions (norms) up to this many elements compile as one-pass (persistent)
    Triton kernels with fixed launch configs; ``None`` keeps inductor's limit, 1024. Needs
    ``optimization.compile.enabled``."""
    fused_gelu_mlp: bool = False
    """Linear-GELU(tanh)-Linear MLPs with the GELU in cuBLASLt's GEMM epilogues (CUDA)."""
    master_adamw: bool = False
    """FP32 master weights stepped by one Triton kernel for all parameters (CUDA, AdamW with
    ``optimizer.fp32_master_weights`` and ``backend: fused``)."""
    fused_wan_attention: bool = False
    """diffusers' Wan self-attention with one QKV GEMM, and its query and key RMSNorm with the
    rotary embedding in one Triton kernel each way (CUDA)."""


class LoRAConfig(Section):
    """LoRA adapters on the first trainable model, through peft (``optimization.lora``).

    ``prepare`` injects them and freezes the rest of the model; ``null`` (the default) trains
    the whole model. See docs/lora.md.
    """

    rank: int = Field(16, ge=1)
    alpha: float | None = Field(None, gt=0, description="None: the rank (scale alpha/rank = 1)")
    target_modules: list[str] | str = Field(min_length=1)
    """Module names (or name suffixes, such as ``to_q``) to adapt, as peft's
    ``LoraConfig.target_modules``; a string is a regular expression over the full names, or
    ``all-linear``."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    prefix: str = Field(
        "transformer", min_length=1, description="key prefix of the saved adapter file"
    )
    """The pipeline component the adapters belong to: diffusers' ``load_lora_weights`` reads
    ``transformer.*`` keys into ``pipe.transformer`` (``unet`` for U-Nets)."""
    fp8_base: Literal["tensorwise", "rowwise"] | None = None
    """Store the frozen ``nn.Linear`` weights of the adapted model in ``float8_e4m3fn`` with one
    scale per tensor or per output row, dequantised per layer at use (``litegen.precision.fp8_weights``);
    ``null`` keeps them in their dtype."""
