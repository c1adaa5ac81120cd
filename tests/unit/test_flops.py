"""FLOP counting, the peak table, throughput metrics and MFU in the trainer's log."""

from __future__ import annotations

import json
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

import litegen
from litegen.compile import compile_blocks
from litegen.flops import throughput as flops
from litegen.flops.counting import call_compiled
from litegen.flops.throughput import FlopCounter, StepThroughput, mfu, peak_flops, throughput
from litegen.memory import apply_memory_optimizations
from litegen.trainer import Trainer
from litegen.utils.config import CompileConfig, MainConfig, MemoryConfig
from litegen_zoo.real_models import REAL_MODELS


def test_counter_sees_forward_and_backward_matmuls():
    layer = nn.Linear(8, 4, bias=False)
    x = torch.randn(16, 8, requires_grad=True)
    with FlopCounter() as counter:
        layer(x).sum().backward()
    forward = 2 * 16 * 8 * 4
    assert counter.flops == 3 * forward  # backward: one matmul for dx, one for dW


class Block(nn.Module):
    """Attention, a dropout MLP and a conditioning keyword: the ops a DiT block counts."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.5), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor, *, cond: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x) + cond).view(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, depth: int = 2, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(width, width), nn.SiLU())  # stays eager
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cond = self.embed(x.mean(1, keepdim=True))
        for block in self.blocks:
            x = block(x, cond=cond)
        return x.square().mean()


def make_net(checkpoint: str | None = None, compiled: str | None = None) -> Net:
    torch.manual_seed(0)
    net = Net()
    if checkpoint is not None:
        memory = {
            "activation_checkpoint": {
                "enabled": True,
                "selective_ratio": 0.0,
                "inside_compile": checkpoint == "inside",
            }
        }
        apply_memory_optimizations(net, MemoryConfig.model_validate(memory))
    if compiled is not None:
        assert compile_blocks(net, CompileConfig(enabled=True), backend=compiled) == [
            "blocks.0",
            "blocks.1",
        ]
    return net


def train_step(net: Net, count: bool, saved: list[int] | None = None):
    """One step's loss, gradients, FLOP count (when counting) and the RNG state after it."""
    torch.manual_seed(1)
    x = torch.randn(2, 8, 16)
    record = saved.append if saved is not None else lambda _: None

    def pack(t: torch.Tensor) -> torch.Tensor:
        record(t.numel() * t.element_size())
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, FlopCounter() if count else nullcontext() as counter:
        loss = net(x)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    return loss.detach(), grads, counter and counter.flops, torch.get_rng_state()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("checkpoint", [None, "inside", "outside"])
def test_compiled_blocks_count_as_eager_while_running_compiled(checkpoint, fresh_dynamo):
    # Checkpointing outside the compiled block recomputes its whole forward (one compiled call);
    # eager checkpointing stops recomputing after the last saved tensor unless told not to.
    early_stop = set_checkpoint_early_stop(checkpoint != "outside")
    with early_stop:
        _, _, eager_flops, _ = train_step(make_net(checkpoint), count=True)
    compiled = make_net(checkpoint, compiled="aot_eager")
    loss, grads, flops, rng = train_step(compiled, count=True)
    plain_loss, plain_grads, _, plain_rng = train_step(compiled, count=False)
    assert flops == eager_flops > 0  # checkpointing: the recomputed forward counts, as eagerly
    assert torch.equal(loss, plain_loss) and torch.equal(rng, plain_rng)
    assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads)


def test_counting_step_saves_what_a_compiled_step_saves(fresh_dynamo):
    # The min-cut partitioner (inductor's) saves less for backward than eager autograd does, so
    # a counting step that ran the blocks eagerly would save more.
    eager, compiled, counting = [], [], []
    train_step(make_net(), count=False, saved=eager)
    net = make_net(compiled="aot_eager_decomp_partition")
    train_step(net, count=False, saved=compiled)
    train_step(net, count=True, saved=counting)
    assert sum(counting) == sum(compiled) < sum(eager)


def test_counting_changes_no_eager_rounding():
    # FlopCounterMode runs silu_backward through its decomposition, which rounds differently.
    def grads(count: bool) -> dict[str, torch.Tensor]:
        return train_step(make_net(), count=count)[1]

    counted, plain = grads(True), grads(False)
    assert all(torch.equal(counted[name], plain[name]) for name in plain)


def test_composite_ops_count_through_their_decomposition():
    layer = nn.Linear(8, 4, bias=False)
    with torch.inference_mode(), FlopCounter() as counter:  # linear reaches the mode whole
        layer(torch.randn(16, 8))
    assert counter.flops == 2 * 16 * 8 * 4


def test_counting_a_compiled_region_leaves_autocast_casts_real():
    # Autocast caches a parameter's cast; the region's fake run must not leave a fake one there
    # for eager code that uses the same parameter later in the step (diffusers' DiT does).
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), FlopCounter() as counter:
        call_compiled(layer, layer, (x,), {})
        after = layer(x)
    assert torch.equal(after, expected)
    # the region's forward and weight gradient, then the eager forward
    assert counter.flops == 3 * (2 * 4 * 8 * 8)


def test_diffusers_dit_trains_the_same_after_a_counted_compiled_step(fresh_dynamo):
    # diffusers' DiT calls its first block's embedding from outside the block, under autocast.
    spec = REAL_MODELS["dit"]
    batch = spec.batch("tiny", 2, seed=0)

    def losses(count: bool) -> list[float]:
        model = spec.build("tiny", seed=0)
        compile_blocks(model, CompileConfig(enabled=True), backend="eager")
        out = []
        for step in range(2):
            with FlopCounter() if count and step == 0 else nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = spec.loss(model, batch)
                loss.backward()
            out.append(loss.item())
        return out

    assert losses(count=True) == losses(count=False)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * x.sum().item()  # fake tensors have no values


def test_a_compiled_region_that_cannot_run_on_fake_tensors_leaves_the_count_unknown(
    fresh_dynamo, caplog
):
    net = nn.Sequential(DataDependent(), DataDependent())
    compile_blocks(net, CompileConfig(enabled=True), backend="eager")
    with FlopCounter() as counter:
        net(torch.randn(2, 4)).sum().backward()
    assert counter.flops is None
    assert "flops_per_sample" in caplog.text


def test_peak_comes_from_the_override_or_the_table():
    assert peak_flops("cpu") is None
    assert peak_flops("cpu", override_tflops=2.0) == 2e12
    with pytest.raises(ValueError, match="positive"):
        peak_flops("cpu", override_tflops=-1.0)
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H200"),
    ):
        assert peak_flops("cuda") == 790e12  # measured, not the 989 of the datasheet
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H100 PCIe"),
    ):
        assert peak_flops("cuda") == flops.PEAK_TFLOPS["H100 PCIe"].used * 1e12


def test_throughput_and_mfu_arithmetic():
    assert mfu(4e14, step_seconds=1.0, peak=8e14) == 0.5
    assert mfu(4e14, step_seconds=1.0, peak=None) is None
    out = throughput(
        steps=10,
        seconds=2.0,
        samples_per_step=8,
        world_size=2,
        tokens_per_sample=256,
        flops_per_step_per_gpu=1e12,
        peak=1e13,
    )
    assert out == {
        "samples_per_s": 40.0,
        "tokens_per_s": 10240.0,
        "tokens_per_s_per_gpu": 5120.0,
        "mfu": 0.5,
    }
    assert throughput(steps=1, seconds=1.0, samples_per_step=4, world_size=1) == {
        "samples_per_s": 4.0
    }


class Counted(nn.Linear):
    tokens_per_sample = 3

    def flops_per_sample(self) -> float:
        return 1e6


def test_step_throughput_prefers_the_models_own_count_and_skips_counting_without_peak():
    meter = StepThroughput(
        Counted(2, 2), device="cpu", world_size=2, samples_per_step=8, peak_tflops=1.0
    )
    assert meter.flops_per_step_per_gpu == 1e6 * 8 / 2 and meter.tokens_per_sample == 3
    assert meter.count().__class__.__name__ == "nullcontext"
    no_peak = StepThroughput(nn.Linear(2, 2), device="cpu", world_size=1, samples_per_step=8)
    assert no_peak.count().__class__.__name__ == "nullcontext"
    assert "mfu" not in no_peak.metrics(steps=1, seconds=1.0)


def test_trainer_logs_tokens_per_second_and_mfu(tmp_path):
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path),
            "exp_name": "mfu",
            "global_batch_size": 4,
            "max_steps": 4,
            "trainer": {
                "log_every": 2,
                "save_final": False,
                "peak_tflops": 1e-6,
                "tokens_per_sample": 5,
            },
        }
    )
    gen = litegen.initialize(config)
    model = nn.Linear(4, 2, bias=False)
    data = [(torch.randn(4), torch.randn(2)) for _ in range(16)]
    model, optimizer, loader = gen.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)

    def train_step(batch, model):
        x, y = batch
        return (model(x) - y).square().mean()

    trainer = Trainer(gen, train_step, {"model": model, "optimizer": optimizer, "loader": loader})
    trainer.fit()
    assert trainer.throughput.flops_per_step_per_gpu == 2 * (2 * 4 * 4 * 2)  # forward + dW
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert record["tokens_per_s"] == pytest.approx(5 * record["samples_per_s"])
        assert record["tokens_per_s_per_gpu"] == record["tokens_per_s"]  # one rank
        assert record["mfu"] > 0


def _trained_flops(tmp_path, memory: dict) -> float:
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path),
            "global_batch_size": 2,
            "max_steps": 3,
            "trainer": {"log_every": 1, "save_final": False, "peak_tflops": 1e-6},
            "optimization": {"memory": memory},
        }
    )
    gen = litegen.initialize(config)
    torch.manual_seed(0)
    net = Net()
    data = [(torch.randn(8, 16), 0) for _ in range(8)]
    net, optimizer, loader = gen.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), data)
    step = lambda batch, model: model(batch[0])  # noqa: E731
    trainer = Trainer(gen, step, {"model": net, "optimizer": optimizer, "loader": loader})
    trainer.fit()
    return trainer.throughput.flops_per_step_per_gpu


def test_auto_checkpointing_counts_a_training_step_not_its_measuring_step(tmp_path):
    # The measuring step runs every block a second time (counted, dropped) and checkpointed
    # (recomputed in backward); a budget this large then checkpoints nothing.
    auto = {"enabled": True, "selective_ratio": "auto", "memory_budget_gib": 1.0}
    plain = _trained_flops(tmp_path / "plain", {})
    assert plain > 0
    assert _trained_flops(tmp_path / "auto", {"activation_checkpoint": auto}) == plain
