"""The job's device meshes, made here and nowhere else: over every rank for the FSDP2 family
and the sharded EMA, ``(replicate, shard)`` for HSDP, and ``(dp, cp, sp)`` for sequence and
context parallelism.

Each mesh is made once per process group and shared by every caller (the strategies, the EMA,
the sequence-parallel hooks): a 2-D mesh makes process groups, and asking again must not make
more. The strategies spread the model and average gradients over every rank, sequence-parallel
ranks included (``litegen.parallel.sequence.comm`` explains why that gives the right gradient),
so their meshes span the whole job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from litegen.parallel.plan import ParallelPlan

# The meshes made so far, by (device type, shape, dimension names), and the default process
# group they belong to: a new group (a test's next job in one process) starts afresh.
_MESHES: dict[tuple[str, tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}
_MESHES_GROUP: list[object] = [None]


def job_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The job's mesh of this shape, made on first use and shared afterwards. Every rank.

    Example::

        job_mesh("cuda", (2, 4), ("replicate", "shard")) is hsdp_mesh(plan)  # 2 nodes x 4
    """
    world = dist.group.WORLD
    if _MESHES_GROUP[0] is not world:
        _MESHES.clear()
        _MESHES_GROUP[0] = world
    key = (device_type, tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, key[1], mesh_dim_names=key[2])
    return _MESHES[key]


def dp_mesh(plan: ParallelPlan) -> DeviceMesh:
    """1-D mesh over every rank: fsdp2 shards each unit across all of them.

    Example::

        dp_mesh(plan).shape  # 8 ranks
    """
    return job_mesh(plan.device.type, (plan.world_size,), ("shard",))


def sp_mesh(plan: ParallelPlan) -> DeviceMesh:
    """2-D mesh ``(dp, sp)`` over the ranks that share a sample (``sp`` here is
    ``sp_size * cp_size``): rank ``r`` sits at ``(r // seq, r % seq)``, so each group (a row) is
    consecutive ranks, within one node.

    Example::

        sp_mesh(plan).get_group("sp")  # ranks 4..7 for rank 5 of 8 ranks at sp_size 4
    """
    return job_mesh(plan.device.type, (plan.dp_size, plan.seq_size), ("dp", "sp"))


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
    mesh = job_mesh(
        plan.device.type, (plan.dp_size, plan.cp_size, plan.sp_size), ("dp", "cp", "sp")
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
    return job_mesh(plan.device.type, (plan.nnodes, plan.local_world_size), ("replicate", "shard"))
