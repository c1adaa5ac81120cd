"""Device meshes: over every rank for the FSDP2 family, and ``(dp, sp)`` for sequence parallelism.

The strategies spread the model and average gradients over every rank, sequence-parallel ranks
included (``litegen.parallel.sequence.comm`` explains why that gives the right gradient), so
their meshes span the whole job.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from litegen.parallel.plan import ParallelPlan


def dp_mesh(plan: ParallelPlan) -> DeviceMesh:
    """1-D mesh over every rank: fsdp2 shards each unit across all of them.

    Example::

        dp_mesh(plan).shape  # 8 ranks
    """
    return init_device_mesh(plan.device.type, (plan.world_size,), mesh_dim_names=("shard",))


def sp_mesh(plan: ParallelPlan) -> DeviceMesh:
    """2-D mesh ``(dp, sp)``: rank ``r`` sits at ``(r // sp_size, r % sp_size)``, so each
    sequence-parallel group (a row) is ``sp_size`` consecutive ranks, within one node.

    Example::

        sp_mesh(plan).get_group("sp")  # ranks 4..7 for rank 5 of 8 ranks at sp_size 4
    """
    return init_device_mesh(
        plan.device.type, (plan.dp_size, plan.sp_size), mesh_dim_names=("dp", "sp")
    )


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
