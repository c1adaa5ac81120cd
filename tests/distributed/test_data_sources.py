"""A user's bucket sampler and an iterable dataset through prepare and the training loop.

- The bucket sampler survives ``prepare`` (each rank trains on the user's batches, sizes 3 and
  5 kept) and "N steps straight" == "K steps, stop, resume, N-K steps" bitwise at 2 ranks;
  resumed at 4 ranks, the data continues with the user's next batches.
- An iterable dataset (no state of its own) trains through torchdata's StatefulDataLoader and
  resumes bitwise too.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from tests.distributed.harness import run_ranks
from tests.distributed.models import IN_DIM, TOKENS, loss_fn, make_model
from tests.unit.test_data_sources import UserBuckets, user_sequence

pytestmark = pytest.mark.slow

STEPS, STOP = 6, 3


def sample(i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    data = torch.randn(TOKENS, IN_DIM, generator=gen)
    return i, data, torch.tanh(data.flip(-1))


class Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return sample(i)


class Stream(IterableDataset):
    """Samples 0..n-1 in order, no state_dict: resume reads up to the saved position."""

    collate_fn = staticmethod(default_collate)

    def __iter__(self):
        return (sample(i) for i in range(27))


def train(kind: str, root: str, steps: int, **trainer) -> dict:
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": root,
            "checkpoint_dir": f"{root}/ckpt",
            "global_batch_size": 8,
            "max_steps": steps,
            "trainer": {"log_every": 1, "save_final": False, **trainer},
        }
    )
    gen = litegen.initialize(config)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = DataLoader(Indexed(), batch_sampler=UserBuckets()) if kind == "buckets" else Stream()
    model, optimizer, loader = gen.prepare(model, optimizer, data)
    seen: list[list[int]] = []

    def step(batch, model):
        index, data, target = batch
        seen.append(index.tolist())
        return loss_fn(model, (data + 0.1 * torch.randn_like(data), target))

    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    losses = Trainer(gen, step, parts).fit()
    return {"losses": losses, "seen": seen, "weights": gen.full_model_state(model)}


def stop_and_resume(tmp: str) -> dict:
    out = {}
    for kind in ("buckets", "stream"):
        out[kind] = {
            "straight": train(kind, f"{tmp}/{kind}/a", STEPS),
            "first": train(kind, f"{tmp}/{kind}/b", STOP, checkpoint_every=STOP),
            "resumed": train(kind, f"{tmp}/{kind}/b", STEPS, resume_run=f"{tmp}/{kind}/b/ckpt"),
        }
    return out


def resume_at_four(tmp: str) -> dict:
    return train("buckets", f"{tmp}/buckets/b", STEPS, resume_run=f"{tmp}/buckets/b/ckpt")


def test_user_buckets_and_streams_resume_exactly(tmp_path):
    ranks = run_ranks(stop_and_resume, 2, str(tmp_path))
    for kind in ("buckets", "stream"):
        for rank in ranks:
            straight, first, resumed = (rank[kind][k] for k in ("straight", "first", "resumed"))
            assert first["losses"] + resumed["losses"] == straight["losses"], kind
            assert first["seen"] + resumed["seen"] == straight["seen"], kind
            for name, tensor in straight["weights"].items():
                assert torch.equal(tensor, resumed["weights"][name]), (kind, name)
    # The user's batches reach the ranks whole, in turn: rank r takes batch 2 * step + r.
    expected = user_sequence(2 * STEPS)
    for rank, result in enumerate(ranks):
        assert result["buckets"]["straight"]["seen"] == expected[rank::2]
    assert {len(b) for r in ranks for b in r["buckets"]["straight"]["seen"]} == {3, 5}
    # The stream: each rank keeps every other sample, epochs of 27 repeat.
    assert ranks[1]["stream"]["straight"]["seen"][0] == [1, 3, 5, 7]

    # Saved at 2 ranks (6 batches consumed), resumed at 4: batches 6, 7, 8, 9 go on.
    four = run_ranks(resume_at_four, 4, str(tmp_path))
    expected = user_sequence(2 * STOP + 4 * (STEPS - STOP))
    for rank, result in enumerate(four):
        assert result["seen"] == expected[2 * STOP + rank :: 4]
