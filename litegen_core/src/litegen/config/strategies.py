"""The table of parallel strategies: every fact about a strategy that is not its code.

One :class:`StrategyRow` per name of ``optimization.parallel.strategy``. The config's
``strategy`` field, the options a strategy ignores (:data:`STRATEGY_OPTIONS`), the registry of
:mod:`litegen.parallel`, a strategy object's ``master_weights``/``ema_from_copy``/
``shards_parameters``, the rules on the job's shape (:func:`job_shape_problems`, beside the
rule on the global batch, :func:`global_batch_problems`) and on a strategy's own options
(:func:`requirement_problems`), ``litegen inspect-config`` and the table
in docs/strategies.md all read it. A new strategy is its module and one row here.

Like the rest of :mod:`litegen.config`, this module never imports torch.

Example:
    >>> STRATEGIES["fsdp2"].shards_parameters, STRATEGIES["fsdp1"].ema
    (True, 'wrapped copy')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# What a strategy splits over the data-parallel ranks, in the order ZeRO's stages add them.
OPTIMIZER_STATE, GRADIENTS, PARAMETERS = "optimizer state", "gradients", "parameters"

# Options read only where a row says so: its ``options``, its ``master_weights`` (the FP32
# masters of litegen.optim) and its ``ema`` mode (ema.sharded chooses the sharded EMA's layout).
MASTER_WEIGHTS_OPTION = "optimization.optimizer.fp32_master_weights"
SHARDED_EMA_OPTION = "ema.sharded"


@dataclass(frozen=True)
class Requirement:
    """The values that one of a strategy's options may have. ``field`` is dotted from the
    ``optimization`` section; ``allowed`` lists the values that work; ``why`` completes the
    message ``field '<path>': <why>``, with ``{value}`` standing for the value found.

    Example:
        >>> STRATEGIES["zero2"].requires[0].allowed
        ('bucketed',)
    """

    field: str
    allowed: tuple[Any, ...]
    why: str


@dataclass(frozen=True)
class StrategyRow:
    """One strategy: where its class is and what the rest of LiteGen needs to know about it.

    Example:
        >>> STRATEGIES["zero2"].shards
        ('optimizer state', 'gradients')
    """

    name: str
    implementation: str  # "module:Class", imported only when a job uses the strategy
    shards: tuple[str, ...]  # what each rank holds only a part of; () replicates everything
    master_weights: bool  # applies optimization.optimizer.fp32_master_weights
    ema: Literal["sharded", "wrapped copy"]  # litegen.ema.EMA, or an FP32 copy wrapped alike
    options: tuple[str, ...] = ()  # config sections only this row (and those naming them) read
    sequence_parallel: bool = True  # works with optimization.parallel.sp_size > 1
    min_nodes: int = 1
    nodes_why: str = ""  # why it needs min_nodes, for the message
    one_node: str = ""  # the strategy to use instead on fewer nodes
    requires: tuple[Requirement, ...] = ()

    @property
    def shards_parameters(self) -> bool:
        """Each rank holds a shard of the parameters, so a forward is collective."""
        return PARAMETERS in self.shards

    @property
    def reads(self) -> tuple[str, ...]:
        """Every option of :data:`STRATEGY_OPTIONS` that this strategy reads."""
        masters = (MASTER_WEIGHTS_OPTION,) if self.master_weights else ()
        ema = (SHARDED_EMA_OPTION,) if self.ema == "sharded" else ()
        return (*self.options, *masters, *ema)


# The option sections of the rows below.
ZERO_OPTIONS = "optimization.parallel.zero"
FSDP2_OPTIONS = "optimization.parallel.fsdp2"
FSDP_MIXED_OPTIONS = "optimization.precision.fsdp_mixed"

RENAMED_OPTIONS: dict[str, dict[str, str]] = {
    "parallel": {"zero1": "zero"},
    "precision": {"fsdp2_mixed": "fsdp_mixed"},
}
"""``optimization`` subsection -> an earlier name of one of its option sections -> its name now.
The earlier names, each naming one of the strategies that read the section, still load
(recipes, saved run configs, overrides) with a :class:`~litegen.config.base.DeprecatedFieldWarning`."""


TABLE: tuple[StrategyRow, ...] = (
    StrategyRow(
        "ddp",
        "litegen.parallel.ddp:DDPStrategy",
        shards=(),
        master_weights=True,  # every rank steps the whole model and keeps every master
        ema="sharded",
    ),
    StrategyRow(
        "zero1",
        "litegen.parallel.zero1:Zero1Strategy",
        shards=(OPTIMIZER_STATE,),
        master_weights=True,
        ema="sharded",
        options=(ZERO_OPTIONS,),
    ),
    StrategyRow(
        "zero2",
        "litegen.parallel.zero2:Zero2Strategy",
        shards=(OPTIMIZER_STATE, GRADIENTS),
        master_weights=True,
        ema="sharded",
        options=(ZERO_OPTIONS,),
        requires=(
            Requirement(
                "parallel.zero.parameter_sync",
                ("bucketed",),
                "zero2 needs 'bucketed', got {value!r}: it shards gradients with its own "
                "buckets, and ZeroRedundancyOptimizer ('native') only shards optimizer state "
                "(use zero1)",
            ),
        ),
    ),
    StrategyRow(
        "fsdp1",
        "litegen.parallel.fsdp1:Fsdp1Strategy",
        shards=(OPTIMIZER_STATE, GRADIENTS, PARAMETERS),
        master_weights=False,
        # Parameters are views into flat shards, so the EMA is an FP32 copy wrapped alike.
        ema="wrapped copy",
        options=(FSDP_MIXED_OPTIONS,),
        sequence_parallel=False,
        requires=(
            Requirement(
                "precision.fsdp_mixed.output_dtype",
                (None,),
                "FSDP1 has no equivalent of {value!r}; unset it for strategy 'fsdp1', or use "
                "strategy 'fsdp2'",
            ),
        ),
    ),
    StrategyRow(
        "fsdp2",
        "litegen.parallel.fsdp2:Fsdp2Strategy",
        shards=(OPTIMIZER_STATE, GRADIENTS, PARAMETERS),
        master_weights=True,  # the master step reaches DTensor shards through to_local()
        ema="sharded",
        options=(FSDP2_OPTIONS, FSDP_MIXED_OPTIONS),
    ),
    StrategyRow(
        "hsdp",
        "litegen.parallel.fsdp2:HsdpStrategy",
        shards=(OPTIMIZER_STATE, GRADIENTS, PARAMETERS),
        master_weights=True,
        ema="sharded",
        options=(FSDP2_OPTIONS, FSDP_MIXED_OPTIONS),
        min_nodes=2,
        nodes_why="replicates across nodes",
        one_node="fsdp2",
    ),
)

STRATEGIES: dict[str, StrategyRow] = {row.name: row for row in TABLE}
"""Strategy name -> its row."""

DEFAULT_STRATEGY: str = TABLE[0].name


def _readers() -> dict[str, tuple[str, ...]]:
    options = [option for row in TABLE for option in row.options]
    readers = {
        option: tuple(row.name for row in TABLE if option in row.reads)
        for option in [*dict.fromkeys(options), MASTER_WEIGHTS_OPTION, SHARDED_EMA_OPTION]
    }
    return {path: names for path, names in readers.items() if len(names) < len(TABLE)}


STRATEGY_OPTIONS: dict[str, tuple[str, ...]] = _readers()
"""Options that only some strategies read: config path -> the strategies that read it. Set
away from its default under any other strategy, an option does nothing, and the config warns
(:func:`litegen.config.checks.ignored_options`). Options every strategy reads are not listed."""


def strategy_row(name: str) -> StrategyRow:
    """The row of ``name``; ``ValueError`` naming the known strategies otherwise.

    >>> strategy_row("hsdp").min_nodes
    2
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"optimization.parallel.strategy {name!r} is unknown; use one of "
            f"{', '.join(STRATEGIES)}."
        )
    return STRATEGIES[name]


def names_where(keep: Callable[[StrategyRow], bool]) -> list[str]:
    """The strategies whose row passes ``keep``, in table order, for messages and tests.

    >>> names_where(lambda row: not row.sequence_parallel)
    ['fsdp1']
    """
    return [row.name for row in TABLE if keep(row)]


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Problem:
    """One broken rule: the field to change and why. ``error`` is what the runtime raises.

    >>> str(Problem("optimization.parallel.sp_size", "3 does not divide 4"))
    "field 'optimization.parallel.sp_size': 3 does not divide 4"
    """

    field: str
    text: str
    error: type[Exception] = ValueError

    def __str__(self) -> str:
        return f"field '{self.field}': {self.text}"


def job_shape_problems(
    *,
    world_size: int,
    nnodes: int,
    strategy: str | None = None,
    sp_size: int = 1,
    cp_size: int = 1,
    where: str = "optimization",
) -> list[Problem]:
    """The rules on the job's shape (ranks and nodes) that a parallel layout breaks.

    ``inspect-config`` and ``launch`` list them from the recipe; :class:`ParallelPlan` raises the
    first. ``where`` is the path of the optimization section (a profile's, say); a ``strategy``
    of None skips the strategy's own rules.

    >>> [str(p) for p in job_shape_problems(world_size=4, nnodes=1, strategy="hsdp")][0][:53]
    "field 'optimization.parallel.strategy': 'hsdp' replic"
    """
    problems = []
    if world_size % (sp_size * cp_size):
        field = "cp_size" if cp_size > 1 and world_size % sp_size == 0 else "sp_size"
        problems.append(
            Problem(
                f"{where}.parallel.{field}",
                f"sp_size {sp_size} * cp_size {cp_size} = {sp_size * cp_size} does not divide "
                f"the world size {world_size} (launch.nproc_per_node * launch.nnodes); launch "
                f"a multiple of {sp_size * cp_size} ranks, or change sp_size or cp_size"
                if cp_size > 1
                else f"{sp_size} does not divide the world size {world_size} "
                f"(launch.nproc_per_node * launch.nnodes); launch a multiple of {sp_size} "
                "ranks, or change sp_size",
            )
        )
    row = STRATEGIES.get(strategy) if strategy is not None else None
    if row is not None and nnodes < row.min_nodes:
        problems.append(
            Problem(
                f"{where}.parallel.strategy",
                f"'{row.name}' {row.nodes_why} and needs launch.nnodes >= {row.min_nodes} (at "
                f"least {row.min_nodes} nodes; this job has {nnodes}); use '{row.one_node}' "
                "on one node",
            )
        )
    return problems


def global_batch_problems(
    *, global_batch_size: int, dp_size: int, grad_accum_steps: int
) -> list[Problem]:
    """The rule that splits a step's samples: ``global_batch_size`` divides evenly into
    ``dp_size`` data-parallel ranks times ``grad_accum_steps`` micro-steps.

    ``inspect-config`` and ``launch`` list it from the recipe; ``litegen.initialize`` raises it.

    >>> [str(p) for p in global_batch_problems(global_batch_size=6, dp_size=2, grad_accum_steps=2)]
    ["field 'global_batch_size': 6 is not divisible by data-parallel size 2 * trainer.grad_accum_steps 2 = 4; use a multiple of 4"]
    """
    per_step = dp_size * grad_accum_steps
    if global_batch_size % per_step == 0:
        return []
    return [
        Problem(
            "global_batch_size",
            f"{global_batch_size} is not divisible by data-parallel size {dp_size} * "
            f"trainer.grad_accum_steps {grad_accum_steps} = {per_step}; use a multiple of "
            f"{per_step}",
        )
    ]


def _value(section: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        section = getattr(section, part)
    return section


def requirement_problems(
    optimization: Any, strategy: str | None = None, where: str = "optimization"
) -> list[Problem]:
    """The values of its own options that a strategy cannot work with.

    ``optimization`` is one resolved ``optimization`` section, ``where`` its path, and
    ``strategy`` the strategy (None: the section's own).

    >>> from litegen.config import OptimizationConfig
    >>> requirement_problems(OptimizationConfig(parallel={"strategy": "zero2",
    ...     "zero": {"parameter_sync": "native"}}))[0].text[:24]
    "zero2 needs 'bucketed', "
    """
    row = STRATEGIES[strategy or optimization.parallel.strategy]
    problems = []
    for need in row.requires:
        value = _value(optimization, need.field)
        if value not in need.allowed:
            problems.append(Problem(f"{where}.{need.field}", need.why.format(value=value)))
    return problems
