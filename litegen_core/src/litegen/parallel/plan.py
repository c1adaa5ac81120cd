"""The parallel plan: which strategy, over how many data- and sequence-parallel ranks, on which
device.

The ranks form a ``(dp, sp)`` mesh: rank ``r`` is sequence-parallel rank ``r % sp_size`` of
data-parallel group ``r // sp_size``, so the ranks of one sequence-parallel group are contiguous
and stay within a node. The ranks of a sequence-parallel group read the same samples; the
strategies still spread the model and average gradients over every rank (see
``litegen.parallel.sequence.comm`` for why that is the right gradient).

Checks that need the job's shape (world size, nodes) live here, so every strategy can trust
its plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from litegen.runtime.distributed import DistEnv


@dataclass(frozen=True)
class ParallelPlan:
    """The shape of the job as the strategies see it.

    Example::

        plan = ParallelPlan.build("ddp", parallel_cfg, DistEnv(), torch.device("cpu"))
        plan.dp_size, plan.sp_size
    """

    strategy: str
    device: torch.device
    world_size: int
    rank: int
    nnodes: int
    local_world_size: int
    sp_size: int = 1

    @property
    def dp_size(self) -> int:
        """Groups of ranks that read different samples."""
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @classmethod
    def build(cls, strategy: str, parallel_cfg, env: DistEnv, device: torch.device) -> ParallelPlan:
        if parallel_cfg.cp_size > 1:
            raise NotImplementedError(
                f"optimization.parallel.cp_size={parallel_cfg.cp_size}: ring attention is "
                "reserved; set cp_size: 1 and split long sequences with sp_size instead."
            )
        sp_size = parallel_cfg.sp_size
        if env.world_size % sp_size:
            raise ValueError(
                f"optimization.parallel.sp_size={sp_size} must divide the world size "
                f"{env.world_size}; launch a multiple of {sp_size} ranks or change sp_size."
            )
        if strategy == "hsdp" and env.nnodes < 2:
            raise ValueError(
                "optimization.parallel.strategy 'hsdp' replicates across nodes and needs at "
                f"least 2 nodes, but this job has {env.nnodes}; use 'fsdp2' on one node, or "
                "launch with launch.nnodes >= 2."
            )
        return cls(
            strategy=strategy,
            device=device,
            world_size=env.world_size,
            rank=env.rank,
            nnodes=env.nnodes,
            local_world_size=env.local_world_size,
            sp_size=sp_size,
        )
