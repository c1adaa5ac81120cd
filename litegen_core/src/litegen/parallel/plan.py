"""The parallel plan: which strategy, over how many data-parallel ranks, on which device.

Checks that need the job's shape (world size, nodes) live here, so every strategy can trust
its plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from litegen.runtime.distributed import DistEnv

# Degrees the config reserves for model parallelism that LiteGen does not implement yet.
_RESERVED_DEGREES = ("sp_size", "cp_size")


@dataclass(frozen=True)
class ParallelPlan:
    """The shape of the job as the strategies see it.

    Example:
        >>> plan = ParallelPlan.build("ddp", parallel_cfg, DistEnv(), torch.device("cpu"))
        >>> plan.dp_size
        1
    """

    strategy: str
    device: torch.device
    world_size: int
    rank: int
    nnodes: int
    local_world_size: int

    @property
    def dp_size(self) -> int:
        # Every rank is a data-parallel rank while tp/sp/cp/pp are 1.
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank

    @classmethod
    def build(cls, strategy: str, parallel_cfg, env: DistEnv, device: torch.device) -> ParallelPlan:
        for field in _RESERVED_DEGREES:
            degree = getattr(parallel_cfg, field)
            if degree > 1:
                raise NotImplementedError(
                    f"optimization.parallel.{field}={degree}: only data parallelism is "
                    f"implemented; set {field}: 1."
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
        )
