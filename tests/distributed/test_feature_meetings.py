"""Features that meet under a sharding strategy: EMA sampling right after validation, and
the training that follows an EMA sample."""

from __future__ import annotations

import tempfile

import pytest
import torch

from litegen.config.strategies import STRATEGIES, names_where
from tests.distributed.harness import run_ranks
from tests.distributed.models import PairDataset, loss_fn, make_model


def sample_after_validate(strategy: str) -> list[tuple[int, float]]:
    """Two steps with validate and sample both due at step 2, each running the model."""
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    seen = []

    def validate(model, loader):
        data, _ = next(iter(loader))
        return model(data.to(torch.float32)).float().pow(2).mean()

    def sample(model, gen, step):
        ema_out = model(torch.ones(2, 4, 8)).float().sum().item()
        seen.append((step, ema_out))
        return None

    with tempfile.TemporaryDirectory(prefix="litegen-test-") as results:
        config = MainConfig.from_dict(
            {
                "runtime": {"device": "cpu"},
                "results_dir": results,
                "global_batch_size": 8,
                "max_steps": 2,
                "ema": {"enable": True, "decay": 0.5},
                "optimization": {"parallel": {"strategy": strategy}},
                "trainer": {
                    "log_every": 1,
                    "save_final": False,
                    "sample_every": 2,
                    "validate_every": 2,
                },
            }
        )
        gen = litegen.initialize(config)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(40))
        parts = {"model": model, "optimizer": optimizer, "loader": loader}
        step = lambda batch, model: loss_fn(model, batch)  # noqa: E731
        Trainer(gen, step, parts, sample_fn=sample, validate_fn=validate).fit()
        # The model's own weights came back: a forward after the hooks runs on them.
        after = model(torch.ones(2, 4, 8)).float().sum().item()
        ema = gen.full_ema_state()
    return {"seen": seen, "after": after, "ema_keys": len(ema)}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_sampling_from_the_ema_right_after_validation(strategy):
    world = 2 * STRATEGIES[strategy].min_nodes  # 2 ranks a (simulated) node
    ranks = run_ranks(sample_after_validate, world, strategy, local_world_size=2)
    assert [step for step, _ in ranks[0]["seen"]] == [2]
    assert ranks[0]["seen"][0][1] != ranks[0]["after"]  # the EMA weights, not the model's


def losses_around_an_ema_sample(strategy: str, sample_every: int) -> list[float]:
    """Three steps' losses, with a forward of the EMA weights after step 2 when sampling."""
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    def sample(model):
        model(torch.ones(2, 4, 8))

    with tempfile.TemporaryDirectory(prefix="litegen-test-") as results:
        config = MainConfig.from_dict(
            {
                "runtime": {"device": "cpu"},
                "results_dir": results,
                "global_batch_size": 8,
                "max_steps": 3,
                "ema": {"enable": True, "decay": 0.5},
                "optimization": {"parallel": {"strategy": strategy}},
                "trainer": {"log_every": 1, "save_final": False, "sample_every": sample_every},
            }
        )
        gen = litegen.initialize(config)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, loader = gen.prepare(model, optimizer, PairDataset(40))
        losses = []

        def step(batch, model):
            loss = loss_fn(model, batch)
            losses.append(loss.item())
            return loss

        parts = {"model": model, "optimizer": optimizer, "loader": loader}
        Trainer(gen, step, parts, sample_fn=sample if sample_every else None).fit()
    return losses


@pytest.mark.parametrize(
    "strategy", names_where(lambda row: row.shards_parameters and row.min_nodes == 1)
)
def test_sampling_from_the_ema_leaves_the_following_losses_alone(strategy):
    # fsdp1 keeps the root unit's gathered weights after a no-grad forward: the sample's
    # forward must not leave the EMA's there for the next training step.
    plain = run_ranks(losses_around_an_ema_sample, 2, strategy, 0)[0]
    sampled = run_ranks(losses_around_an_ema_sample, 2, strategy, 2)[0]
    assert sampled == plain


class ConvVAE(torch.nn.Module):
    """A VAE-like encoder: convolutions and a GroupNorm, with an ``encode`` method."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.GroupNorm(2, 8),
            torch.nn.SiLU(),
            torch.nn.Conv2d(8, 4, 3, stride=2, padding=1),
        )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net[0].weight.dtype))


def prepare_beside_a_vae(strategy: str, cast: str | None) -> dict:
    """The README's quick start: ``prepare(model, optimizer, vae, dataset)``, then one step."""
    import litegen
    from litegen.utils.config import MainConfig

    optimization = {"parallel": {"strategy": strategy}}
    if cast:
        optimization["precision"] = {"cast_model": cast}
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "global_batch_size": 8,
            "max_steps": 2,
            "optimization": optimization,
        }
    )
    gen = litegen.initialize(config)
    torch.manual_seed(0)
    vae, frozen_by_hand = ConvVAE(), ConvVAE().requires_grad_(False)
    images = torch.randn(2, 3, 8, 8)
    dtype = {"bf16": torch.bfloat16, None: torch.float32}[cast]
    expected = [m.to(dtype).encode(images) for m in (vae, frozen_by_hand)]
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, vae, frozen_by_hand, _loader = gen.prepare(
        model, optimizer, vae, frozen_by_hand, PairDataset(16)
    )
    out = {"same": [], "plain": [], "grad": [], "dtype": [], "eval": []}
    for module, want in zip((vae, frozen_by_hand), expected, strict=True):
        got = module.encode(images)
        out["same"].append(torch.equal(got, want))
        out["plain"].append(
            type(module) is ConvVAE
            and all(type(p) is torch.nn.Parameter for p in module.parameters())
        )
        out["grad"].append(any(p.requires_grad for p in module.parameters()))
        out["dtype"].append({p.dtype for p in module.parameters()} == {dtype})
        out["eval"].append(not module.training)
    # The trained model still trains, and its optimizer holds no state for the VAE.
    loss_fn(model, (torch.randn(4, 4, 8), torch.randn(4, 4, 8))).backward()
    optimizer.step()
    vae_ids = {id(p) for p in vae.parameters()}
    out["optim_vae_state"] = any(id(p) in vae_ids for p in optimizer.state)
    return out


@pytest.mark.parametrize(
    ("strategy", "cast"),
    [
        ("ddp", None),
        ("zero1", None),
        ("zero2", None),
        ("fsdp1", None),
        ("fsdp2", None),
        ("fsdp2", "bf16"),
        ("hsdp", None),
    ],
)
def test_a_model_no_optimizer_steps_comes_back_plain_and_frozen(strategy, cast):
    # hsdp: 2 simulated nodes of 2 ranks.
    world, local = (4, 2) if strategy == "hsdp" else (2, 2)
    out = run_ranks(prepare_beside_a_vae, world, strategy, cast, local_world_size=local)[0]
    assert out == {
        "same": [True, True],
        "plain": [True, True],
        "grad": [False, False],
        "dtype": [True, True],
        "eval": [True, True],
        "optim_vae_state": False,
    }
