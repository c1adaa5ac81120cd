"""The job's meshes are made in litegen/parallel/mesh.py, once per process group: the strategy,
the sharded EMA and the sequence-parallel hooks that ask for one get the same mesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from litegen.parallel.mesh import dp_mesh, hsdp_mesh, sequence_groups, sp_mesh
from litegen.parallel.plan import ParallelPlan

PLAN = ParallelPlan(
    strategy="fsdp2", device=torch.device("cpu"), world_size=1, rank=0, nnodes=1, local_world_size=1
)


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group of its own, destroyed afterwards."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_each_mesh_is_made_once_and_shared(one_rank):
    assert dp_mesh(PLAN) is dp_mesh(PLAN)
    assert hsdp_mesh(PLAN) is hsdp_mesh(PLAN)
    assert sp_mesh(PLAN) is sp_mesh(PLAN)
    assert sequence_groups(PLAN).sequence is sp_mesh(PLAN).get_group("sp")
    assert dp_mesh(PLAN) is not hsdp_mesh(PLAN)  # another shape, another mesh
    assert hsdp_mesh(PLAN).mesh_dim_names == ("replicate", "shard")


def test_a_new_process_group_gets_new_meshes(tmp_path):
    meshes = []
    for i in range(2):
        store = dist.FileStore(str(tmp_path / f"store{i}"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            meshes.append(dp_mesh(PLAN))
            assert meshes[-1].get_group() is not None
        finally:
            dist.destroy_process_group()
    assert meshes[0] is not meshes[1]
