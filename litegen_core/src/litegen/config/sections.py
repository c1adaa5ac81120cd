"""The typed sections of ``MainConfig`` for the runtime and optimization (and its profiles).

Import the public names from :mod:`litegen.config`; this module only exists to keep
each file readable. It must never import torch (the CLI imports it for fast validation).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from litegen.config.base import ConfigError, ProfileSection, Section
from litegen.parallel import STRATEGIES

Dtype = Literal["fp32", "bf16", "fp16"]
"""Names accepted by every dtype field."""

StrategyName = Literal[tuple(STRATEGIES)]  # type: ignore[valid-type]
"""The registered parallel strategies (:data:`litegen.parallel.STRATEGIES`)."""


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


class Zero1Config(Section):
    """Options of the ``zero1`` strategy (``optimization.parallel.zero1``)."""

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

    strategy: StrategyName = "ddp"
    zero1: Zero1Config = Field(default_factory=Zero1Config)
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


class FSDP2MixedConfig(Section):
    """FSDP2 mixed-precision policy (``optimization.precision.fsdp2_mixed``)."""

    param_dtype: Dtype | None = None
    reduce_dtype: Dtype | None = None
    output_dtype: Dtype | None = None
    cast_forward_inputs: bool = True


PRECISION_PRESETS: dict[str, dict[str, Any]] = {
    # Parameters stored (and gathered, and reduced) in bf16, stepped through FP32 masters; the
    # forward runs under bf16 autocast (MainConfig sets trainer.autocast).
    "bf16-mixed": {
        "precision": {"cast_model": "bf16"},
        "optimizer": {"fp32_master_weights": True},
    },
}
"""``optimization.precision.preset`` -> the optimization fields it sets (unless set explicitly)."""


class PrecisionConfig(Section):
    """Model dtype cast and mixed precision (``optimization.precision``)."""

    preset: Literal[tuple(PRECISION_PRESETS)] | None = None  # type: ignore[valid-type]
    """A named combination of the fields below, ``optimizer.fp32_master_weights`` and
    ``trainer.autocast``; fields written in the config win over it."""
    cast_model: Dtype | None = None
    cast_exclude_paths: list[str] = Field(default_factory=list)
    fsdp2_mixed: FSDP2MixedConfig = Field(default_factory=FSDP2MixedConfig)
    allow_tf32: bool = True
    fp8_linear: Literal["tensorwise", "rowwise"] | None = None
    """FP8 matmuls in the trained model's ``nn.Linear`` layers through torchao's float8 recipes
    (``litegen.fp8_training``; CUDA with compute capability 8.9+ and the ``torchao`` extra);
    elsewhere it steps aside with one warning. ``null``: off."""


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

    enabled: bool = False
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "default"
    )
    dynamic: bool | None = False
    options: dict[str, Any] = Field(default_factory=dict)
    """Inductor options passed as ``torch.compile(options=...)``, e.g.
    ``coordinate_descent_tuning: true``; torch allows them only with ``mode: default``."""


def blocks_to_checkpoint(selective_ratio: float, candidates: int) -> int:
    """How many of ``candidates`` blocks a numeric ``selective_ratio`` checkpoints: all but
    ``round(selective_ratio * candidates)`` (halves rounded up), so 1.0 checkpoints none.

    >>> blocks_to_checkpoint(0.2, 28), blocks_to_checkpoint(1.0, 28), blocks_to_checkpoint(0, 28)
    (22, 0, 28)
    """
    return candidates - math.floor(selective_ratio * candidates + 0.5)


class ActivationCheckpointConfig(Section):
    """Activation checkpointing (``optimization.memory.activation_checkpoint``)."""

    enabled: bool = False
    selective_ratio: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = Field(
        1.0, description="share left uncheckpointed; auto: the least that fits the budget"
    )
    """``auto`` measures the first training step (every candidate checkpointed) and, from the
    second step, checkpoints the fewest blocks whose estimated peak fits ``memory_budget_gib``
    (or ``memory_budget_fraction`` of the device), offloading only if ``activation_offload``
    allows it and checkpointing alone does not fit."""
    memory_budget_gib: float | None = Field(
        None, gt=0, description="selective_ratio auto: peak device memory to fit, in GiB"
    )
    memory_budget_fraction: float = Field(
        0.9, gt=0.0, le=1.0, description="selective_ratio auto without memory_budget_gib"
    )
    target_paths: list[str] = Field(default_factory=list)
    policy: Literal["block", "ops", "ops_all", "memory_budget"] = "block"
    """``block`` recomputes whole blocks; ``ops`` keeps matmul/attention outputs but those that
    widen their input 4x (MLP up-projections) and recomputes the rest; ``ops_all`` keeps every
    matmul/attention output;
    ``memory_budget`` (needs ``optimization.compile``) lets compile's partitioner choose what
    every compiled block saves, within ``memory_budget``."""
    memory_budget: float = Field(
        0.5, ge=0.0, le=1.0, description="policy memory_budget: 0 saves least, 1 as compile does"
    )
    inside_compile: bool = True
    """With ``optimization.compile``: ``true`` compiles each block with its checkpoint inside
    (compile's partitioner plans the recompute; op-level policies need it), ``false``
    checkpoints the compiled block from outside (as ``checkpoint_wrapper(compiled_block)``)."""

    @model_validator(mode="after")
    def _auto_rules(self) -> ActivationCheckpointConfig:
        fields = type(self).model_fields
        budget_fields = [
            name
            for name in ("memory_budget_fraction", "memory_budget_gib")
            if getattr(self, name) != fields[name].default
        ]
        if self.selective_ratio != "auto" and budget_fields:
            raise ValueError(
                f"{', '.join(budget_fields)} sets the budget of selective_ratio: auto, "
                f"and selective_ratio is {self.selective_ratio}; set selective_ratio: auto, or "
                "remove the budget."
            )
        if self.selective_ratio == "auto" and self.policy != "block":
            raise ValueError(
                "selective_ratio: auto chooses how many blocks to checkpoint whole, and policy is "
                f"{self.policy}; use policy: block with auto, or a number for selective_ratio."
            )
        if not self.inside_compile and self.policy in ("ops", "ops_all"):
            raise ValueError(
                f"policy {self.policy} chooses ops inside the compiled block, which it sees only "
                "with the checkpoint inside compile; set inside_compile: true, or policy: block."
            )
        return self

    def checkpointed_blocks(self, candidates: int) -> int | None:
        """How many of a model's ``candidates`` blocks get checkpointed (``target_paths``, when
        set, are the candidates); None when decided later (``selective_ratio: auto`` on the first
        step, ``policy: memory_budget`` by compile's partitioner).

        >>> ActivationCheckpointConfig(enabled=True).checkpointed_blocks(28)  # ratio 1.0
        0
        """
        if not self.enabled:
            return 0
        if self.selective_ratio == "auto" or self.policy == "memory_budget":
            return None
        n = len(self.target_paths) if self.target_paths else candidates
        return blocks_to_checkpoint(self.selective_ratio, n)

    def checkpoints_nothing(
        self, where: str = "optimization.memory.activation_checkpoint"
    ) -> str | None:
        """The warning for ``enabled: true`` with ``selective_ratio: 1.0`` (the default), which
        checkpoints no block of any model; None otherwise. ``where`` is the section's path.

        >>> ActivationCheckpointConfig(enabled=True).checkpoints_nothing()[:46]
        'optimization.memory.activation_checkpoint.enab'
        """
        if not self.enabled or self.policy == "memory_budget" or self.selective_ratio != 1.0:
            return None
        return (
            f"{where}.enabled is true, but selective_ratio is 1.0 (the default: the share of "
            f"blocks left uncheckpointed), so no block is checkpointed; set {where}."
            "selective_ratio: 0 to checkpoint every block (0.5 for half, auto to fit a memory "
            "budget), or enabled: false."
        )


class BlockSwapConfig(Section):
    """Frozen base weights streamed from host memory (``optimization.memory.block_swap``)."""

    blocks_on_device: int = Field(0, ge=0)
    """Repeated blocks (the first, in forward order) whose frozen weights stay on the device;
    the others' wait in pinned host memory and are copied in ahead of each use."""


class MemoryConfig(Section):
    """Memory savers (``optimization.memory``)."""

    activation_checkpoint: ActivationCheckpointConfig = Field(
        default_factory=ActivationCheckpointConfig
    )
    activation_offload: bool = False
    """Offload the saved activations of the candidate blocks to pinned host memory:
    checkpointed blocks' inputs, everything other blocks save (the last block keeps its own).
    Needs no checkpointing; with ``selective_ratio: auto`` it lets the planner offload when
    checkpointing alone cannot meet the budget."""
    mlp_chunk_tokens: int | None = Field(None, ge=1)
    """Linear-GELU(tanh)-Linear MLPs keep only their input for backward and run this many tokens
    at a time, recomputing their hidden activation in backward (``litegen.memory.chunked_mlp``):
    for long sequences, where those wide activations set the peak; one more GEMM per MLP."""
    block_swap: BlockSwapConfig | None = None
    """Under LoRA, keep the frozen base weights of all but ``blocks_on_device`` repeated blocks
    in pinned host memory and stream them in ahead of use (``litegen.memory.block_swap``);
    ``null``: every weight on the device."""


class KernelsConfig(Section):
    """Kernel replacements (``optimization.kernels``)."""

    fused_layernorm: bool = False
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math", "flash_attn"] = "auto"
    """Scaled-dot-product-attention kernel for the run (see ``litegen.kernels.attention``)."""


class ExperimentalConfig(Section):
    """Kernels that patch private or beta APIs (``optimization.experimental``), all off.

    Each runs only on the torch release it was tested on and otherwise steps aside with a
    one-line warning (``litegen.experimental``).
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
    scale per tensor or per output row, dequantised per layer at use (``litegen.fp8_weights``);
    ``null`` keeps them in their dtype."""


@functools.cache
def profile_model(section: type[Section]) -> type[ProfileSection]:
    """Partial twin of ``section``: same fields and constraints, all optional.

    Defaults are ``None`` and never validated, so an explicit ``null`` is still checked
    against the real type. ``profile_model(OptimizationConfig)`` is ``OptimizationProfile``.
    """
    fields: dict[str, Any] = {}
    for name, info in section.model_fields.items():
        if name == "profiles":
            continue
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            fields[name] = (profile_model(ann), Field(None, description=info.description))
        else:
            if info.metadata:
                ann = Annotated[(ann, *info.metadata)]
            fields[name] = (ann, Field(None, description=info.description))
    name = section.__name__.removesuffix("Config") + "Profile"
    doc = f"Partial ``{section.__name__}`` inside ``optimization.profiles``."
    return create_model(name, __base__=ProfileSection, __doc__=doc, **fields)


def value_at(data: Any, *keys: str) -> Any:
    """``data[k0][k1]...`` of nested mappings, or None where a level is missing."""
    for key in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class OptimizationConfig(Section):
    """Performance options (``optimization``); ``profiles`` holds named partial overrides."""

    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    experimental: ExperimentalConfig = Field(default_factory=ExperimentalConfig)
    lora: LoRAConfig | None = None
    profiles: dict[str, OptimizationProfile] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _expand_precision_preset(cls, data: Any) -> Any:
        preset = value_at(data, "precision", "preset")
        if preset not in PRECISION_PRESETS:
            return data  # None, or a name the field's own validation rejects
        return _deep_merge(PRECISION_PRESETS[preset], data)

    def resolve(self, profile: str | None = None) -> OptimizationConfig:
        """General settings for ``None``, else the profile merged over them.

        >>> opt = OptimizationConfig(profiles={"frozen": {"memory": {"activation_offload": True}}})
        >>> opt.resolve("frozen").memory.activation_offload, opt.resolve(None) is opt
        (True, True)
        """
        if profile is None:
            return self
        if profile not in self.profiles:
            available = ", ".join(repr(p) for p in self.profiles) or "none defined"
            raise ValueError(
                f"Unknown optimization profile {profile!r}; available profiles: {available}"
            )
        # Only what was written merges, so the result still knows which fields were set.
        base = self.model_dump(exclude_unset=True)
        base.pop("profiles", None)
        merged = _deep_merge(base, self.profiles[profile].model_dump(exclude_unset=True))
        try:
            return type(self).model_validate(merged)
        except ConfigError as exc:
            raise exc.with_prefix("optimization", "profiles", profile) from None

    @field_validator("experimental")
    @classmethod
    def _experimental_needs(cls, value: ExperimentalConfig, info: Any) -> Any:
        compile_cfg, memory = info.data.get("compile"), info.data.get("memory")
        if value.persistent_rows is not None and compile_cfg and not compile_cfg.enabled:
            raise ValueError(
                "persistent_rows changes the kernels that compile generates, and compile is off; "
                "set optimization.compile.enabled: true, or leave persistent_rows unset."
            )
        if value.fused_gelu_mlp and memory and memory.mlp_chunk_tokens is not None:
            raise ValueError(
                "fused_gelu_mlp and optimization.memory.mlp_chunk_tokens both replace the GELU "
                "MLPs' forward; keep mlp_chunk_tokens for memory, or fused_gelu_mlp for speed."
            )
        return value

    @model_validator(mode="after")
    def _profiles_resolve(self) -> OptimizationConfig:
        # A profile is partial, so rules across fields (experimental.persistent_rows needs
        # compile.enabled) can be checked only once it is merged over the general settings.
        # Merge each one now, so that a broken profile fails at load, not when a model uses it.
        for name in self.profiles:
            try:
                self.resolve(name)
            except ConfigError as exc:
                raise ValueError("; ".join(f"{p}: {m}" for p, m in exc.problems)) from None
        return self


OptimizationProfile = profile_model(OptimizationConfig)
OptimizationConfig.model_rebuild()
