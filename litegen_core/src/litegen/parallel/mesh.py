"""Device meshes: over every rank for the FSDP2 family, and ``(dp, cp, sp)`` for sequence and
context parallelism.

The strategies spread the model and average gradients over every rank, sequence-parallel ranks
included (``litegen.parallel.sequence.comm`` explains why that gives the right gradient), so
their meshes span the whole job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from litegen.parallel.plan import ParallelPlan


def dp_mesh(plan: ParallelPlan) -> DeviceMesh:
    """1-D mesh over every rank: fsdp2 shards each unit across all of them.

    Example::

        dp_mesh(plan).shape  # 8 ranks
    """
    return init_device_mesh(plan.device.type, (plan.world_size,), mesh_dim_names=("shard",))


def sp_mesh(plan: ParallelPlan) -> DeviceMesh:
    """2-D mesh ``(dp, sp)`` over the ranks that share a sample (``sp`` here is
    ``sp_size * cp_size``): rank ``r`` sits at ``(r // seq, r % seq)``, so each group (a row) is
    consecutive ranks, within one node.

    Example::

        sp_mesh(plan).get_group("sp")  # ranks 4..7 for rank 5 of 8 ranks at sp_size 4
    """
    return init_device_mesh(
        plan.device.type, (plan.dp_size, plan.seq_size), mesh_dim_names=("dp", "sp")
    )


@dataclass(frozen=True)
class SequenceGroups:
    """The process groups of one sample's ranks: the whole sequence group (split and gather),
    its Ulysses group (all-to-alls, ``sp_size`` consecutive ranks) and its ring group
    (``cp_size`` ranks, ``sp_size`` apart; None without context parallelism)."""

    sequence: dist.ProcessGroup
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup | None = None


def sequence_groups(plan: ParallelPlan) -> SequenceGroups:
    """The groups of this rank's sample, from the ``(dp, cp, sp)`` mesh.

    Rank ``r`` holds shard ``r % (sp_size * cp_size)`` of its sample's sequence; a Ulysses
    all-to-all over its ``sp`` row gathers the ``cp_rank``-th contiguous chunk, which the ring
    passes round the ``cp`` column.

    Example::

        groups = sequence_groups(plan)  # 8 ranks, sp_size 4, cp_size 2
        dist.get_world_size(groups.ulysses), dist.get_world_size(groups.ring)  # 4, 2
    """
    whole = sp_mesh(plan).get_group("sp")
    if plan.cp_size == 1:
        return SequenceGroups(whole, whole)
    mesh = init_device_mesh(
        plan.device.type,
        (plan.dp_size, plan.cp_size, plan.sp_size),
        mesh_dim_names=("dp", "cp", "sp"),
    )
    return SequenceGroups(whole, mesh.get_group("sp"), mesh.get_group("cp"))


def hsdp_mesh(plan: ParallelPlan) -> DeviceMesh:
    """2-D mesh ``(replicate=nnodes, shard=local_world_size)``: shard inside a node, where the
    links are fast, and replicate across nodes, so only gradients cross the slower network.

    Rank ``r`` sits at ``(r // local_world_size, r % local_world_size)``, which matches
    torchrun's node-major rank order.

    Example::

        hsdp_mesh(plan).mesh_dim_names  # 2 nodes x 4 GPUs
    """
    assert plan.nnodes * plan.local_world_size == plan.world_size, "plan checks the job shape"
    return init_device_mesh(
        plan.device.type,
        (plan.nnodes, plan.local_world_size),
        mesh_dim_names=("replicate", "shard"),
    )
