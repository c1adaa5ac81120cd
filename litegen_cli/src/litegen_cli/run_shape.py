"""The run shape: world size, the (data-parallel x ring x Ulysses) mesh, per-rank
micro batch and sequence length.

Computed from the recipe alone (no torch, no process group), so a bad batch size or degree is
caught by `inspect-config` and by `launch` before any rank starts. The attention heads belong to
the model the entry builds, so that sp_size divides them is checked by `prepare`, and by
`inspect-config --estimate`, which builds the model on meta (:mod:`litegen_cli.estimate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from litegen.config.strategies import (
    DEFAULT_STRATEGY,
    FSDP2_OPTIONS,
    STRATEGIES,
    job_shape_problems,
    requirement_problems,
)
from litegen_cli.recipe import Recipe, RecipeError, layout_problems

AUTO_DEVICE = "auto (cuda if available, else cpu)"


@dataclass(frozen=True)
class RunShape:
    """What one launch will do, in numbers."""

    world_size: int
    dp_size: int
    sp_size: int
    grad_accum_steps: int
    global_batch_size: int
    micro_batch: int
    strategy: str
    device: str
    memory: str = "off"  # activation checkpointing and offload, in words
    weights: str = "on the device, in their dtype"  # parameter offload and fp8, in words
    # Tokens each rank holds of a sample's sequence (trainer.tokens_per_sample / (sp * cp),
    # rounded up: the sequence is padded to a multiple of sp * cp); None when unset.
    tokens_per_rank: int | None = None
    cp_size: int = 1


def _get(section: Any, name: str, default: Any) -> Any:
    """Read an optional field; sections may be missing or hold None."""
    if section is None:
        return default
    try:
        value = getattr(section, name)
    except (AttributeError, KeyError):  # Config raises KeyError for a missing key
        return default
    if isinstance(value, Enum):  # print enums as their value
        value = value.value
    return default if value is None else value


def derive_run_shape(recipe: Recipe) -> RunShape:
    """Derive the run shape; raise RecipeError when the batch does not split evenly over ranks.

    Example:
        >>> from pathlib import Path
        >>> from litegen_cli.recipe import load_recipe
        >>> _ = Path("entry.py").write_text("def build(config): ...\\ndef train_step(batch): ...\\n")
        >>> _ = Path("recipe.yaml").write_text("launch: {entry: entry.py}\\nglobal_batch_size: 8\\n")
        >>> plan = derive_run_shape(load_recipe("recipe.yaml", ["launch.nproc_per_node=2"]))
        >>> plan.world_size, plan.micro_batch
        (2, 4)
    """
    cfg = recipe.config
    parallel = _get(_get(cfg, "optimization", None), "parallel", None)
    world = recipe.launch.nproc_per_node * recipe.launch.nnodes
    strategy = str(_get(parallel, "strategy", DEFAULT_STRATEGY))
    sp = int(_get(parallel, "sp_size", 1))
    cp = int(_get(parallel, "cp_size", 1))
    trainer = _get(cfg, "trainer", None)
    accum = int(_get(trainer, "grad_accum_steps", 1))
    gbs = int(_get(cfg, "global_batch_size", 1))

    problems = layout_problems(
        world=world,
        sp=sp,
        cp=cp,
        accum=accum,
        global_batch=gbs,
    )
    dp = max(world // (sp * cp), 1)
    problems += runtime_refusals(recipe)
    if problems:
        raise RecipeError(problems)

    device = _get(_get(cfg, "runtime", None), "device", None)
    tokens = _get(trainer, "tokens_per_sample", None)
    return RunShape(
        memory=_memory(_get(_get(cfg, "optimization", None), "memory", None)),
        weights=_weights(_get(cfg, "optimization", None)),
        world_size=world,
        dp_size=dp,
        sp_size=sp,
        cp_size=cp,
        grad_accum_steps=accum,
        global_batch_size=gbs,
        micro_batch=gbs // (dp * accum),
        strategy=strategy,
        device=str(device) if device else AUTO_DEVICE,
        tokens_per_rank=-(-int(tokens) // (sp * cp)) if tokens else None,
    )


def _memory(memory: Any) -> str:
    """Activation checkpointing and offload as the run shape table shows them."""
    ac = _get(memory, "activation_checkpoint", None)
    parts = []
    if _get(ac, "enabled", False):
        ratio = _get(ac, "selective_ratio", 1.0)
        if ratio == "auto":
            budget = _get(ac, "memory_budget_gib", None)
            within = (
                f"{budget} GiB"
                if budget is not None
                else f"{_get(ac, 'memory_budget_fraction', 0.9):.0%} of device memory"
            )
            parts.append(f"checkpointing auto within {within}: chosen on the first step")
        else:
            parts.append(f"checkpointing {_checkpointed(ac)}, policy {_get(ac, 'policy', 'block')}")
    if _get(memory, "activation_offload", False):
        parts.append("activation offload")
    swap = _get(memory, "block_swap", None)
    if swap is not None:
        kept = _get(swap, "blocks_on_device", 0)
        parts.append(f"block swap: frozen weights of all but {kept} blocks in host memory")
    return "; ".join(parts) or "off"


def _checkpointed(ac: Any) -> str:
    """How many blocks a numeric ``selective_ratio`` checkpoints, as far as the recipe tells:
    the block count belongs to the model, so it is a count only with ``target_paths``."""
    ratio = float(_get(ac, "selective_ratio", 1.0))
    targets = _get(ac, "target_paths", None)
    if targets:
        return f"{ac.checkpointed_blocks(len(targets))} of the {len(targets)} target_paths blocks"
    if ratio >= 1.0:
        return "no block (selective_ratio 1.0; lower it to checkpoint)"
    if ratio <= 0.0:
        return "every block (selective_ratio 0.0)"
    example = ", ".join(f"{ac.checkpointed_blocks(n)} of {n}" for n in (12, 28))
    return f"{1 - ratio:.0%} of the model's blocks (selective_ratio {ratio}: {example})"


def _weights(optimization: Any) -> str:
    """Where parameters and optimizer state live and in which precision, as the run shape table shows it."""
    parts = []
    parallel = _get(optimization, "parallel", None)
    strategy = str(_get(parallel, "strategy", DEFAULT_STRATEGY))
    offload = parallel is not None and parallel.fsdp2.cpu_offload
    if offload and FSDP2_OPTIONS in STRATEGIES[strategy].options:
        parts.append("parameters, gradients and optimizer state in host memory (cpu_offload)")
    fp8_base = _get(_get(optimization, "lora", None), "fp8_base", None)
    if fp8_base is not None:
        parts.append(f"frozen Linear weights in fp8 ({fp8_base})")
    fp8_linear = _get(_get(optimization, "precision", None), "fp8_linear", None)
    if fp8_linear is not None:
        parts.append(f"fp8 Linear matmuls ({fp8_linear}, where the GPU and torchao allow)")
    return "; ".join(parts) or "on the device, in their dtype"


def runtime_refusals(recipe: Recipe) -> list[str]:
    """What the ranks would refuse at start-up that the recipe already shows, one line each.

    Checked for the general ``optimization`` section and every profile.

    Example:
        >>> from pathlib import Path
        >>> from litegen_cli.recipe import load_recipe
        >>> _ = Path("entry.py").write_text("def build(config): ...\\ndef train_step(batch): ...\\n")
        >>> _ = Path("recipe.yaml").write_text("launch: {entry: entry.py}\\nglobal_batch_size: 8\\n")
        >>> runtime_refusals(load_recipe("recipe.yaml", ["optimization.parallel.strategy=hsdp"]))
        ["field 'optimization.parallel.strategy': 'hsdp' replicates across nodes and needs ..."]
    """
    cfg = recipe.config
    device = cfg.runtime.device
    problems = []
    if device == "npu":
        problems.append("field 'runtime.device': 'npu' is reserved; use 'cuda' or 'cpu'")
    sections = {"optimization": cfg.optimization}
    for name in cfg.optimization.profiles:
        sections[f"optimization.profiles.{name}"] = cfg.optimization_for(name)
    for where, opt in sections.items():
        strategy = opt.parallel.strategy
        # The strategy's rules, as the ranks apply them (litegen.config.strategies).
        shape = job_shape_problems(
            world_size=recipe.launch.nproc_per_node * recipe.launch.nnodes,
            nnodes=recipe.launch.nnodes,
            strategy=strategy,
            where=where,
        )
        problems += [str(p) for p in [*shape, *requirement_problems(opt, where=where)]]
        fsdp2 = opt.parallel.fsdp2
        if (
            FSDP2_OPTIONS in STRATEGIES[strategy].options
            and fsdp2.wrap_strategy == "manual"
            and not fsdp2.wrap_paths
        ):
            problems.append(
                f"field '{where}.parallel.fsdp2.wrap_paths': wrap_strategy 'manual' needs the "
                "module paths to shard"
            )
        if device == "cpu" and opt.optimizer.backend == "fused":
            problems.append(
                f"field '{where}.optimizer.backend': 'fused' needs CUDA parameters and "
                "runtime.device is cpu; use foreach or single_tensor"
            )
        if opt.compile.options and opt.compile.mode != "default":
            problems.append(
                f"field '{where}.compile.options': torch.compile takes inductor options only "
                f"with mode: default (mode is {opt.compile.mode!r})"
            )
    return problems
