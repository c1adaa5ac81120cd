"""The job's shape: where a worker sits in it (:class:`DistEnv`, from torchrun's variables) and
the parallel plan the strategies see (:class:`ParallelPlan`).

The ranks form a ``(dp, cp, sp)`` mesh: rank ``r`` is Ulysses rank ``r % sp_size`` and ring
(context-parallel) rank ``(r // sp_size) % cp_size`` of data-parallel group
``r // (sp_size * cp_size)``, so the ranks that share a sample are contiguous and stay within a
node, and each Ulysses group (the all-to-alls) is the innermost, fastest one. The ranks of a sequence-parallel group read the same samples; the
strategies still spread the model and average gradients over every rank (see
``litegen.parallel.sequence.comm`` for why that is the right gradient).

The rules on the job's shape (:func:`litegen.config.strategies.job_shape_problems`) hold for
every plan built here, so every strategy can trust its plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from litegen.config.strategies import job_shape_problems


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells a worker about its place in the job.

    Example:
        >>> DistEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank
        1
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launched: bool = False  # True under torchrun (or any launcher that sets RANK)

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        if "RANK" not in environ:
            return cls()
        world_size = int(environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(environ["RANK"]),
            world_size=world_size,
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world_size))),
            launched=True,
        )


@dataclass(frozen=True)
class ParallelPlan:
    """The shape of the job as the strategies see it.

    Example::

        plan = ParallelPlan.build("ddp", parallel_cfg, DistEnv(), torch.device("cpu"))
        plan.dp_size, plan.sp_size, plan.cp_size
    """

    strategy: str
    device: torch.device
    world_size: int
    rank: int
    nnodes: int
    local_world_size: int
    sp_size: int = 1
    cp_size: int = 1

    @property
    def seq_size(self) -> int:
        """Ranks that share each sample's sequence: ``sp_size * cp_size``."""
        return self.sp_size * self.cp_size

    @property
    def dp_size(self) -> int:
        """Groups of ranks that read different samples."""
        return self.world_size // self.seq_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.seq_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.sp_size) % self.cp_size

    @classmethod
    def build(
        cls, strategy: str, parallel_cfg: Any, env: DistEnv, device: torch.device
    ) -> ParallelPlan:
        problems = job_shape_problems(
            world_size=env.world_size,
            nnodes=env.nnodes,
            strategy=strategy,
            sp_size=parallel_cfg.sp_size,
            cp_size=parallel_cfg.cp_size,
        )
        if problems:
            raise problems[0].error(f"{problems[0]}.")
        return cls(
            strategy=strategy,
            device=device,
            world_size=env.world_size,
            rank=env.rank,
            nnodes=env.nnodes,
            local_world_size=env.local_world_size,
            sp_size=parallel_cfg.sp_size,
            cp_size=parallel_cfg.cp_size,
        )
