"""The global-batch sampler: disjoint rank slices, exact union with one process, resumable."""

import pytest
import torch

from litegen.data import GlobalBatchSampler, build_dataloader, pair_collate
from litegen.utils.config import MainConfig


def batches(dp_size, accum=1, start=0, steps=5, n=37, g=8, seed=3):
    out = []
    for rank in range(dp_size):
        sampler = GlobalBatchSampler(
            n,
            global_batch_size=g,
            max_steps=steps,
            dp_rank=rank,
            dp_size=dp_size,
            grad_accum_steps=accum,
            seed=seed,
        )
        sampler.start_step = start
        out.append(list(sampler))
    return out


@pytest.mark.parametrize(("dp_size", "accum"), [(2, 1), (4, 1), (2, 2), (1, 4)])
def test_ranks_and_microsteps_recompose_the_single_process_batch(dp_size, accum):
    (single,) = batches(1)
    sharded = batches(dp_size, accum)
    for step in range(5):
        union = []
        for micro in range(accum):
            for rank in range(dp_size):
                union += sharded[rank][step * accum + micro]
        assert union == single[step]


def test_slices_are_disjoint_within_a_step_and_cover_the_epoch():
    ranks = batches(2, steps=4, n=16, g=4)
    seen = [i for step in range(4) for rank in ranks for i in rank[step]]
    assert sorted(seen) == list(range(16))


def test_epochs_are_different_permutations_and_deterministic():
    (a,) = batches(1, steps=4, n=8, g=4)
    (b,) = batches(1, steps=4, n=8, g=4)
    assert a == b
    assert sorted(a[0] + a[1]) == sorted(a[2] + a[3]) == list(range(8))
    assert a[0] + a[1] != a[2] + a[3]


def test_resume_from_a_step_continues_the_same_sequence_at_any_world_size():
    (full,) = batches(1, steps=6)
    resumed = batches(2, start=3, steps=6)
    assert [resumed[0][i] + resumed[1][i] for i in range(3)] == full[3:]
    assert len(GlobalBatchSampler(37, global_batch_size=8, max_steps=6)) == 6


def test_batch_that_does_not_divide_names_the_fix():
    with pytest.raises(
        ValueError, match=r"multiple of data-parallel size x trainer.grad_accum_steps"
    ):
        GlobalBatchSampler(10, global_batch_size=6, max_steps=1, dp_size=4)


def test_pair_collate_stacks_data_and_lists_captions():
    data, captions = pair_collate([(torch.ones(2), "a cat"), (torch.zeros(2), "a dog")])
    assert data.shape == (2, 2) and list(captions) == ["a cat", "a dog"]
    with pytest.raises(ValueError, match="collate_fn"):
        pair_collate([torch.ones(2)])


def test_dataloader_uses_the_dataset_collate_fn_and_config():
    class WithCollate(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": torch.tensor(float(i))}

        @staticmethod
        def collate_fn(samples):
            return torch.stack([s["x"] for s in samples])

    config = MainConfig(global_batch_size=4, max_steps=2, global_seed=1)
    loader = build_dataloader(WithCollate(), config=config, dp_rank=0, dp_size=2)
    out = list(loader)
    assert len(out) == 2 and all(b.shape == (2,) for b in out)


def test_to_device_moves_nested_tensors_and_keeps_containers():
    from collections import namedtuple

    from litegen.data import to_device

    Pair = namedtuple("Pair", "x y")
    batch = {"a": (torch.ones(1), ["text", torch.zeros(2)]), "b": Pair(torch.ones(3), 7)}
    moved = to_device(batch, torch.device("meta"))
    assert moved["a"][0].device.type == "meta" and moved["a"][1][0] == "text"
    assert isinstance(moved["b"], Pair) and moved["b"].x.device.type == "meta" and moved["b"].y == 7
