"""Real diffusers transformers under every strategy (gloo, CPU ranks): they train as DDP does.

The eight architectures of ``litegen_zoo.real_models`` at their tiny sizes train a few steps under
ddp, zero1, zero2, fsdp1 and fsdp2 on 2 ranks, and under ddp and hsdp on 4 ranks as 2 simulated
nodes; a covering set of runs adds activation checkpointing, CPU offload, chunked MLPs and regional
compile. Starting ranks costs seconds, so one group of processes runs every 2-rank case of every
model (``initialize`` and ``prepare`` again for each, on a fresh model) and one more every 4-rank
case; the tests then assert on the returned results one case at a time.

Losses and final weights are compared with DDP's at ``rtol=1e-5, atol=1e-6``: fp32 throughout,
the same global batches, and strategies that differ only in the order gradients are summed.
The optimizer is SGD with momentum (state to shard, like Adam's), whose update is linear in the
gradient, so a partial or wrongly scaled reduction shows in the weights; Adam's update hardly
depends on the gradient's scale. hsdp is compared with ddp on the same 4 ranks: DiT drops class
labels at random per rank, so its batches depend on the number of ranks.
"""

from __future__ import annotations

import pytest
import torch

from litegen.config.strategies import names_where
from litegen.model_parts.blocks import repeated_blocks
from litegen_zoo.real_models import REAL_MODELS
from tests.distributed.harness import run_ranks
from tests.distributed.models import TinyDiT
from tests.distributed.runs import full_weights

pytestmark = pytest.mark.slow

# Imported here, once: forked ranks inherit the classes instead of importing diffusers each.
MODEL_CLASSES = [spec.model_class() for spec in REAL_MODELS.values()]

STEPS = 3
GLOBAL_BATCH = 4
# The sharding strategies of the table that run on one node, each compared with the others'.
STRATEGIES = tuple(names_where(lambda row: bool(row.shards) and row.min_nodes == 1))
REPLICATED = tuple(names_where(lambda row: not row.shards))
CHECKPOINT = {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.0}}
OPTIONS = {
    "checkpoint": {"memory": CHECKPOINT},
    "offload": {"memory": CHECKPOINT | {"activation_offload": True}},
    "compile": {"compile": {"enabled": True}},
    "chunked_mlp": {"memory": CHECKPOINT | {"mlp_chunk_tokens": 7}},
}
# Each option under several strategies and models, every strategy with some option (offload
# is not offered under fsdp2/hsdp). Compile is the costly one (Dynamo traces diffusers' blocks,
# seconds each), so it runs where it meets sharding units; test_compile_strategies.py covers
# ddp, zero1, zero2 and hsdp.
OPTION_CASES = [
    ("dit", "fsdp2", "compile"),  # a nested unit inside a compiled block
    ("wan", "fsdp1", "compile"),
    ("dit", "fsdp1", "offload"),
    ("pixart", "zero2", "offload"),
    ("ltx_video", "ddp", "offload"),
    ("wan", "zero1", "offload"),
    ("sd3", "fsdp2", "checkpoint"),
    ("cogvideox", "zero2", "checkpoint"),
    ("hunyuan_video", "fsdp2", "checkpoint"),
    ("wan", "fsdp1", "checkpoint"),
    ("wan", "fsdp2", "chunked_mlp"),  # compiled: tests/unit/test_chunked_mlp.py
]
HSDP_OPTION_CASES = [("dit", "hsdp", "checkpoint"), ("flux", "hsdp", "checkpoint")]


class SampleDataset(torch.utils.data.Dataset):
    """The samples of one synthetic batch of ``name``'s tiny config (dicts of tensors)."""

    collate_fn = staticmethod(torch.utils.data.default_collate)

    def __init__(self, name: str, n: int) -> None:
        self.batch = REAL_MODELS[name].batch("tiny", batch_size=n, seed=1)

    def __len__(self) -> int:
        return len(self.batch["latents"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def config_for(strategy: str, results: str, optimization: dict | None = None):
    """The test run's config; ``optimization`` sections go over it (``parallel`` merged)."""
    from litegen.utils.config import MainConfig

    optimization = dict(optimization or {})
    parallel = {"strategy": strategy} | optimization.pop("parallel", {})
    return MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": results,
            "global_batch_size": GLOBAL_BATCH,
            "max_steps": STEPS,
            "trainer": {"log_every": 1, "save_final": False},
            "optimization": {"parallel": parallel} | optimization,
        }
    )


def train(name: str, strategy: str, option: str | None, results: str) -> dict:
    """``STEPS`` steps of ``name``'s tiny model: losses, final weights, what the option did."""
    import litegen
    from litegen.trainer import Trainer

    spec = REAL_MODELS[name]
    gen = litegen.initialize(config_for(strategy, results, OPTIONS.get(option)))
    model = spec.build("tiny")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = gen.prepare(model, optimizer, SampleDataset(name, 12))
    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    losses = Trainer(gen, lambda batch, model: spec.loss(model, batch), parts).fit()
    memory = gen.models[-1].memory
    return {
        "losses": losses,
        "state": full_weights(gen, model),
        "checkpointed": len(memory.checkpointed),
        "offloaded": memory.offloader.stats.tensors_offloaded if memory.offloader else 0,
        "chunked_mlps": memory.chunked_mlps,
    }


def run_cases(cases: list[tuple[str, str, str | None]]) -> dict:
    """Each case's results, or the error it raised (so one failing case fails one test)."""
    import tempfile

    import torch._dynamo

    import litegen.compile

    real = litegen.compile.compile_blocks
    compiled: list[str] = []

    def aot_eager(model, cfg, **kwargs):
        # Inductor would build C++ kernels for minutes on a CI CPU; aot_eager runs the same
        # Dynamo graphs and AOTAutograd split eagerly (see test_compile_strategies.py).
        compiled.extend(real(model, cfg, **(kwargs | {"backend": "aot_eager"})))
        return compiled

    litegen.compile.compile_blocks = aot_eager
    out: dict = {}
    for case in cases:
        compiled.clear()
        torch._dynamo.reset()  # as in a fresh process: no graphs of an earlier case's blocks
        try:
            with tempfile.TemporaryDirectory(prefix="litegen-test-") as results:
                out[case] = train(*case, results) | {"compiled": len(compiled)}
        except Exception as err:
            out[case] = f"{type(err).__name__}: {err}"
    return out


class HiddenCall(TinyDiT):
    """Calls a block's layer from outside the block through a computed name: unreadable."""

    def forward(self, data: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(data, t)
        layer = getattr(self.blocks[0], "a" + "da")
        return out + layer(torch.zeros(out.shape[0], out.shape[-1] * 4)).mean()


# What the fsdp2 error tells the user to set for HiddenCall (a unit of its own for the layer).
HIDDEN_FIX = {
    "wrap_strategy": "manual",
    "wrap_paths": ["blocks.0.ada", "blocks.0", "blocks.1", "blocks.2"],
}


def hidden_call_errors(results: str) -> dict[str, str]:
    """What a forward and backward of :class:`HiddenCall` raise under each sharding strategy,
    and under fsdp2 with the units the fsdp2 error suggests."""
    import litegen

    errors = {}
    runs = {"fsdp1": {}, "fsdp2": {}, "fsdp2 fixed": {"parallel": {"fsdp2": HIDDEN_FIX}}}
    for run, optimization in runs.items():
        strategy = run.split()[0]
        gen = litegen.initialize(config_for(strategy, results, optimization))
        model = gen.prepare(HiddenCall())
        try:
            model(torch.randn(2, 4, 8)).sum().backward()
            errors[run] = f"no error under {gen.models[-1].strategy.name}"
        except Exception as err:
            errors[run] = f"{type(err).__name__}: {err}"
    return errors


def two_rank_suite() -> dict:
    import tempfile

    plain = [(name, s, None) for name in REAL_MODELS for s in (*REPLICATED, *STRATEGIES)]
    with tempfile.TemporaryDirectory(prefix="litegen-test-") as results:
        return run_cases(plain + OPTION_CASES) | {"hidden": hidden_call_errors(results)}


def four_rank_suite() -> dict:
    return run_cases(
        [(name, s, None) for name in REAL_MODELS for s in ("ddp", "hsdp")] + HSDP_OPTION_CASES
    )


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_ranks(two_rank_suite, 2)[0]


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run_ranks(four_rank_suite, 4, local_world_size=2)[0]


def assert_like_ddp(results: dict, case: tuple[str, str, str | None]) -> dict:
    got, ddp = results[case], results[case[0], "ddp", None]
    assert not isinstance(ddp, str), f"ddp failed: {ddp}"
    assert not isinstance(got, str), f"{case} failed: {got}"
    assert len(got["losses"]) == STEPS
    torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-5, atol=1e-6)
    # On a mismatch assert_close names the parameter ("failure occurred for item [...]").
    torch.testing.assert_close(got["state"], ddp["state"], rtol=1e-5, atol=1e-6)
    return got


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_strategy_matches_ddp(two_ranks, name, strategy):
    assert_like_ddp(two_ranks, (name, strategy, None))


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_hsdp_matches_ddp(four_ranks, name):
    assert_like_ddp(four_ranks, (name, "hsdp", None))


def assert_option_applied(got: dict, name: str, option: str) -> None:
    """The option reached every repeated block (checkpointed, offloaded, compiled, its MLP
    chunked)."""
    blocks = len(repeated_blocks(REAL_MODELS[name].build("tiny")))
    assert got["compiled"] == (blocks if option == "compile" else 0)
    assert got["checkpointed"] == (0 if option == "compile" else blocks)
    assert (got["offloaded"] > 0) == (option == "offload")
    assert got["chunked_mlps"] == (blocks if option == "chunked_mlp" else 0)


@pytest.mark.parametrize("case", OPTION_CASES, ids="-".join)
def test_memory_and_compile_options_match_ddp(two_ranks, case):
    assert_option_applied(assert_like_ddp(two_ranks, case), case[0], case[2])


@pytest.mark.parametrize("case", HSDP_OPTION_CASES, ids="-".join)
def test_hsdp_options_match_ddp(four_ranks, case):
    assert_option_applied(assert_like_ddp(four_ranks, case), case[0], case[2])


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_a_call_the_reading_misses_raises_one_clear_error(two_ranks, strategy):
    message = two_ranks["hidden"][strategy]
    assert message.startswith(f"ValueError: {strategy}: blocks.0.ada ran outside its sharding ")
    assert "unit blocks.0 (called from HiddenCall.forward)" in message
    fix = "get_fsdp_wrap_module_list()" if strategy == "fsdp1" else HIDDEN_FIX["wrap_paths"]
    assert str(fix) in message


def test_the_suggested_units_fix_the_call(two_ranks):
    assert two_ranks["hidden"]["fsdp2 fixed"] == "no error under fsdp2"
