"""Data as users have it: bucket samplers, a user's own (batch) sampler, iterable streams.

One process each; the distributed versions (through prepare and the trainer, with resume at 2
and 4 ranks) are in tests/distributed/test_data_sources.py.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from litegen.data import (
    BucketBatchSampler,
    GlobalBatchSampler,
    RankBatchSampler,
    RankStream,
    prepare_data,
    worker_share,
)
from litegen.utils.config import MainConfig


# -- a user's bucket batch sampler, as found in training scripts --------------------------------
class UserBuckets(Sampler[list[int]]):
    """Batches of 3 from the first bucket and 5 from the second, shuffled per epoch, resumable."""

    def __init__(self, n: int = 40, seed: int = 7) -> None:
        self.n, self.seed, self.epoch, self.position = n, seed, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed + epoch)
        small = torch.randperm(self.n // 2, generator=gen).tolist()
        large = (torch.randperm(self.n // 2, generator=gen) + self.n // 2).tolist()
        batches = [small[i : i + 3] for i in range(0, len(small) - 2, 3)]
        batches += [large[i : i + 5] for i in range(0, len(large) - 4, 5)]
        order = torch.randperm(len(batches), generator=gen).tolist()
        return [batches[i] for i in order]

    def __iter__(self):
        batches = self.epoch_batches(self.epoch)
        while self.position < len(batches):
            self.position += 1
            yield batches[self.position - 1]
        self.position = 0

    def __len__(self) -> int:
        return len(self.epoch_batches(0))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def user_sequence(batches: int) -> list[list[int]]:
    """The user's batches in order over epochs, as one process would see them."""
    user = UserBuckets()
    out: list[list[int]] = []
    for epoch in itertools.count():
        out += user.epoch_batches(epoch)
        if len(out) >= batches:
            return out[:batches]


def rank_batches(dp_size: int, steps: int, accum: int = 1, resume=None) -> list[list[list[int]]]:
    out = []
    for rank in range(dp_size):
        sampler = RankBatchSampler(
            UserBuckets(), max_steps=steps, dp_rank=rank, dp_size=dp_size, grad_accum_steps=accum
        )
        if resume is not None:
            sampler.load_state_dict(resume)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize(("dp_size", "accum"), [(2, 1), (4, 1), (2, 2)])
def test_a_user_bucket_sampler_keeps_its_batches_and_ranks_take_turns(dp_size, accum):
    steps = 9  # past the end of the first epoch (11 batches)
    per_rank = rank_batches(dp_size, steps, accum)
    expected = user_sequence(steps * dp_size * accum)
    for step in range(steps):
        for micro in range(accum):
            for rank in range(dp_size):
                index = (step * accum + micro) * dp_size + rank
                assert per_rank[rank][step * accum + micro] == expected[index]
    assert {len(b) for b in per_rank[0]} <= {3, 5}


def test_a_user_sampler_resumes_from_its_state_at_another_world_size():
    user = UserBuckets()
    two = RankBatchSampler(user, max_steps=20, dp_rank=1, dp_size=2, lookahead=8)
    drawn = list(itertools.islice(iter(two), 12))  # the loader drew 12 steps ahead ...
    assert len(drawn) == 12
    state = two.state_at(7)  # ... and training consumed 7
    assert state["start_step"] == 7 and state["user"]["batch_sampler"]["epoch"] == 1
    # 7 steps of 2 ranks consumed 14 user batches; 4 ranks go on with batch 14.
    four = rank_batches(4, 9, resume=state)
    expected = user_sequence(14 + 2 * 4)
    assert [four[r][0] for r in range(4)] == expected[14:18]
    assert [four[r][1] for r in range(4)] == expected[18:22]


def test_a_stateless_user_sampler_replays_its_epoch_with_a_warning(caplog):
    plain = BatchSampler(SequentialSampler(range(10)), batch_size=2, drop_last=False)
    sampler = RankBatchSampler(plain, max_steps=8, dp_size=1)
    list(sampler)
    state = sampler.state_at(7)  # epoch 1 (5 batches each), 2 batches in
    assert (state["epoch"], state["drawn"], state["user"]) == (1, 2, {})
    resumed = RankBatchSampler(plain, max_steps=8)
    resumed.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="litegen"):
        assert list(resumed) == [[4, 5]]
    assert "no state_dict" in caplog.text


def test_an_empty_user_sampler_names_itself():
    empty = BatchSampler(SequentialSampler([]), batch_size=2, drop_last=False)
    with pytest.raises(ValueError, match="yielded no batch in epoch 0"):
        list(RankBatchSampler(empty, max_steps=1))


# -- prepare's choices for a user's DataLoader ---------------------------------------------------
def config(**fields) -> MainConfig:
    return MainConfig.from_dict({"global_batch_size": 8, "max_steps": 4, **fields})


def test_a_plain_shuffled_loader_gets_the_global_batch_sampler_and_keeps_its_settings(caplog):
    def init(worker):
        return None

    user = DataLoader(range(40), batch_size=4, shuffle=True, worker_init_fn=init, timeout=5)
    with caplog.at_level(logging.INFO, logger="litegen"):
        loader = prepare_data(user, config=config(), dp_rank=1, dp_size=2)
    assert isinstance(loader.batch_sampler, GlobalBatchSampler) and loader.batch_sampler.shuffle
    assert loader.worker_init_fn is init and loader.timeout == 5
    assert "replaced by LiteGen's resumable global-batch sampler" in caplog.text
    sequential = prepare_data(DataLoader(range(40), batch_size=4), config=config(), **ONE)
    assert next(iter(sequential)).tolist() == list(range(8))


ONE = {"dp_rank": 0, "dp_size": 1}


def test_a_custom_batch_sampler_is_kept_and_split():
    loader = prepare_data(
        DataLoader(range(40), batch_sampler=UserBuckets()), config=config(), dp_rank=1, dp_size=2
    )
    assert isinstance(loader.batch_sampler, RankBatchSampler)
    expected = user_sequence(8)
    assert [b.tolist() for b in loader] == expected[1::2]


def test_a_bucket_batch_sampler_gets_the_job_fields():
    keys = ["a"] * 16 + ["b"] * 16
    loader = DataLoader(range(32), batch_sampler=BucketBatchSampler(keys))
    prepared = prepare_data(loader, config=config(global_seed=3), dp_rank=0, dp_size=2)
    sampler = prepared.batch_sampler
    assert (sampler.global_batch_size, sampler.max_steps, sampler.dp_size, sampler.seed) == (
        8,
        4,
        2,
        3,
    )
    assert all(len({keys[i] for i in b.tolist()}) == 1 for b in prepared)


def test_a_rank_aware_sampler_must_match_the_ranks():
    sampler = DistributedSampler(range(40), num_replicas=4, rank=1, shuffle=False)
    with pytest.raises(ValueError, match=r"num_replicas=4, rank=1.*part 1 of 2"):
        prepare_data(
            DataLoader(range(40), batch_size=2, sampler=sampler),
            config=config(),
            dp_rank=1,
            dp_size=2,
        )
    sampler = DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=False)
    loader = prepare_data(
        DataLoader(range(40), batch_size=4, sampler=sampler), config=config(), dp_rank=1, dp_size=2
    )
    assert [b.tolist() for b in loader][:2] == [[1, 3, 5, 7], [9, 11, 13, 15]]


# -- the built-in bucket sampler -----------------------------------------------------------------
KEYS = [(8, 8)] * 20 + [(8, 16)] * 13 + [(16, 16)] * 9


def buckets(dp_size=1, accum=1, start=0, steps=12, seed=5):
    out = []
    for rank in range(dp_size):
        sampler = BucketBatchSampler(
            KEYS,
            global_batch_size=4,
            max_steps=steps,
            dp_rank=rank,
            dp_size=dp_size,
            grad_accum_steps=accum,
            seed=seed,
        )
        sampler.load_state_dict(sampler.state_at(start))
        out.append(list(sampler))
    return out


def test_bucket_batches_hold_one_shape_and_ranks_recompose_them():
    (single,) = buckets()
    assert all(len({KEYS[i] for i in batch}) == 1 for batch in single)
    epoch = single[:10]  # 5 + 3 + 2 whole batches of 4 per epoch
    assert len({i for b in epoch for i in b}) == 40
    assert single[10:] != epoch[:2]  # epoch 2 is shuffled anew
    for dp_size, accum in ((2, 1), (4, 1), (2, 2)):
        sharded = buckets(dp_size, accum)
        for step in range(12):
            union = [
                i
                for micro in range(accum)
                for rank in range(dp_size)
                for i in sharded[rank][step * accum + micro]
            ]
            assert union == single[step]


def test_bucket_sampler_resumes_at_any_world_size_and_is_deterministic():
    (single,) = buckets()
    assert buckets()[0] == single and buckets(seed=6)[0] != single
    resumed = buckets(dp_size=2, start=7)
    assert [resumed[0][i] + resumed[1][i] for i in range(5)] == single[7:]


def test_a_bucket_smaller_than_a_global_batch_gives_no_empty_batch():
    keys = ["a"] * 4 + ["b"] * 2 + ["c"]  # "c" waits: it never fills a batch of 2
    for seed in range(4):
        batches = list(BucketBatchSampler(keys, global_batch_size=2, max_steps=9, seed=seed))
        assert all(len(batch) == 2 for batch in batches)
        assert 6 not in {i for batch in batches for i in batch}


def test_bucket_sampler_errors_name_the_fix():
    with pytest.raises(ValueError, match="no bucket holds a whole global batch of 32"):
        BucketBatchSampler(KEYS, global_batch_size=32, max_steps=1)
    with pytest.raises(ValueError, match=r"pass the DataLoader to gen\.prepare"):
        list(BucketBatchSampler(KEYS))


def test_bucketed_shapes_keep_recompiles_bounded_with_dynamic_null():
    """Four resolutions from the bucket sampler through compiled blocks: with ``dynamic: null``
    the first shape compiles static and one more compile serves the rest (Dynamo counts 3
    frames for it: the recompile is entered twice); ``dynamic: false`` compiles every shape.
    Dynamo decides recompiles from its guards, whatever the backend, so the test counts them
    with ``eager`` (``aot_eager`` counts the same and takes ten times longer); forward only,
    under no_grad, since backward never recompiles."""
    from torch._dynamo.testing import CompileCounter

    from litegen.compile import compile_blocks
    from litegen.utils.config import CompileConfig
    from litegen_zoo.dit_model import DiT, DiTConfig

    keys = KEYS + [(16, 24)] * 4
    sampler = BucketBatchSampler(keys, global_batch_size=4, max_steps=11, seed=1)
    shapes = [keys[batch[0]] for batch in sampler]
    assert len(set(shapes)) == 4 and len(set(shapes[:2])) == 2

    def compiles(dynamic):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = DiT(DiTConfig(hidden=32, depth=2, heads=2, num_classes=10))
        counter = CompileCounter()
        compile_blocks(model, CompileConfig(enabled=True, dynamic=dynamic), backend=counter)
        with torch.no_grad():
            for h, w in shapes:
                x = torch.randn(4, h * w // 4, model.cfg.in_dim)  # 2x2 patches
                model(x, torch.randint(0, 1000, (4,)))
        torch._dynamo.reset()
        return counter.frame_count

    assert compiles(None) <= 3
    assert compiles(False) == 4


# -- iterable datasets ---------------------------------------------------------------------------
class Stream(IterableDataset):
    """Numbers 0..n-1, split between loader workers; no state of its own."""

    collate_fn = staticmethod(torch.utils.data.default_collate)

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        return iter(range(worker, self.n, workers))


class StatefulStream(Stream):
    """The same numbers with torchdata's protocol: the position is its state."""

    def __init__(self, n: int = 23) -> None:
        super().__init__(n)
        self.position = 0

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            yield self.position - 1
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_rank_stream_splits_cycles_and_resumes_by_replay_or_state():
    def take(stream, k):
        return list(itertools.islice(iter(stream), k))

    ranks = [RankStream(Stream(5), dp_rank=r, dp_size=2) for r in range(2)]
    assert take(ranks[0], 6) == [0, 2, 4, 0, 2, 4]  # each epoch is split anew
    assert take(ranks[1], 4) == [1, 3, 1, 3]
    for dataset in (Stream(), StatefulStream()):
        stream = RankStream(dataset, dp_rank=1, dp_size=2)
        straight = take(stream, 20)
        first = RankStream(type(dataset)(), dp_rank=1, dp_size=2)
        iterator = iter(first)
        head = [next(iterator) for _ in range(14)]
        state = first.state_dict()
        second = RankStream(type(dataset)(), dp_rank=1, dp_size=2)
        second.load_state_dict(state)
        assert head + take(second, 6) == straight


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_resumes_exactly_through_the_stateful_loader(workers):
    pytest.importorskip("torchdata")
    cfg = config(global_batch_size=6, num_workers=workers)

    def loader():
        return prepare_data(StatefulStream(), config=cfg, dp_rank=1, dp_size=2)

    straight = [b.tolist() for b in itertools.islice(iter(loader()), 12)]
    first = loader()
    iterator = iter(first)
    head = [next(iterator).tolist() for _ in range(5)]
    state = first.state_dict()
    second = loader()
    second.load_state_dict(state)
    assert head + [b.tolist() for b in itertools.islice(iter(second), 7)] == straight
    assert all(len(b) == 3 for b in straight)


def test_worker_share_gives_each_rank_and_worker_its_shards():
    shards = [f"part-{i}" for i in range(6)]
    assert worker_share(shards, rank=1, world_size=3) == ["part-1", "part-4"]
    with pytest.raises(ValueError, match="cannot give each of 8 ranks"):
        worker_share(shards, rank=0, world_size=8)


def test_a_dataset_with_set_rank_reads_its_own_part():
    class Shards(IterableDataset):
        collate_fn = staticmethod(torch.utils.data.default_collate)

        def set_rank(self, rank, world_size):
            self.mine = worker_share(list(range(10)), rank, world_size)

        def __iter__(self):
            return iter(self.mine)

    pytest.importorskip("torchdata")
    loader = prepare_data(Shards(), config=config(global_batch_size=4), dp_rank=1, dp_size=2)
    assert [b.tolist() for b in itertools.islice(iter(loader), 3)] == [[1, 3], [5, 7], [9, 1]]


def test_a_random_sampler_with_replacement_is_kept_and_split():
    # Not plain shuffling: it draws with replacement, so LiteGen keeps it.
    sampler = RandomSampler(range(20), replacement=True, num_samples=8)
    loader = prepare_data(
        DataLoader(range(20), batch_size=2, sampler=sampler), config=config(), **ONE
    )
    assert isinstance(loader.batch_sampler, RankBatchSampler)
