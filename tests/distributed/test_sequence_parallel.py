"""Ulysses sequence parallelism on gloo CPU ranks: sp > 1 computes what sp = 1 computes.

- Every built-in plan (Wan, LTX-Video, HunyuanVideo, CogVideoX, DiT, PixArt at their tiny sizes
  from litegen_zoo/real_models.py): one step at sp = 2 and sp = 4 gives the loss and the gradients
  of one process on the whole batch, with token counts that do not divide by sp (padding).
  A custom model's own plan, with a key mask, likewise; the video entries of the built-in plans
  agree with diffusers' context-parallel plans.
- Training through the real loop equals sp = 1 (dp only) on the same ranks: ddp with
  activation checkpointing and offload, zero1, zero2 with selective checkpointing (policy ops),
  compile of checkpointed blocks (aot_eager: one graph, no graph break), and
  dp x sp = 2 x 2 under fsdp2 (with checkpointing and EMA) and hsdp (two simulated nodes), with
  gradient clipping; Wan with its fused self-attention (``experimental.fused_wan_attention``).
- Resume across sp: a run checkpoint of sp = 2 continues at sp = 1, and the reverse.
- The collectives against their definitions (forward and adjoint), a copy of a prepared model
  run on one rank with sequence parallelism off, and the error for heads that do not divide.

fp32 throughout: sequence parallelism only changes the order of sums (attention over all
tokens runs once, on whole sequences), so losses, gradients and weights agree to rounding
(``rtol=1e-5``; the training runs use SGD, since Adam's normalised update would magnify the
rounding in gradients whose true value is zero). Starting ranks costs seconds, so one group of
2 ranks and one of 4 run every case, and the tests assert on the returned results one property
at a time.
"""

from __future__ import annotations

import copy
import functools
import tempfile

import diffusers
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from litegen.parallel.sequence import SequencePlan, Split
from litegen.parallel.sequence.builtin_plans import BUILTIN, family_plans
from litegen_zoo.real_models import REAL_MODELS, LatentShape
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

MODELS = ("wan", "ltx_video", "hunyuan_video", "cogvideox", "dit", "pixart")
# Latent sizes whose token counts do not divide by 2 or 4 where the model allows it (LTX: 9
# tokens, HunyuanVideo: 3, Wan: 6); the others keep their tiny size (8 or 16 tokens).
SHAPES = {
    "wan": LatentShape(6, 4, frames=1, text_tokens=6),
    "ltx_video": LatentShape(3, 3, frames=1, text_tokens=6),
    "hunyuan_video": LatentShape(6, 2, frames=1, text_tokens=6),
}
# Imported here, once, so that the forked ranks inherit the model classes (seconds each).
MODEL_CLASSES = [getattr(diffusers, REAL_MODELS[name].class_name) for name in MODELS]
STEPS = 4
GLOBAL_BATCH = 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
CHECKPOINT = {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.0}}


def config_of(name: str, heads: int) -> dict:
    """Tiny config with ``heads`` heads and the hidden size unchanged (32)."""
    config = {"num_attention_heads": heads, "attention_head_dim": 32 // heads}
    if name == "hunyuan_video":  # its rotary axes split the head dim
        config["rope_axes_dim"] = {2: (4, 6, 6), 4: (2, 2, 4)}[heads]
    return config


def batch_of(name: str, heads: int, batch_size: int, seed: int = 1) -> dict:
    spec = REAL_MODELS[name]
    config = spec.config("tiny") | config_of(name, heads)
    return spec.batch("tiny", batch_size, seed, SHAPES.get(name), config)


class Attention(nn.Module):
    """Self-attention over all tokens, with a mask of the valid keys of the whole sequence."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x), valid)
        return x + self.mlp(x)


class CustomDiT(nn.Module):
    """A model of the user's, with the plan it declares (docs/sequence_parallel.md)."""

    litegen_sp_plan = SequencePlan(
        split_inputs={"blocks.0": {"x": 1}},
        gather_outputs={"head": 1},
        attention={"blocks.*.attn": "self"},
    )

    def __init__(self, heads: int = 2, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(2))
        self.head = nn.Linear(dim, 4)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, valid)
        return self.head(x)


def custom_cases() -> dict:
    """The custom model at sp = 2 (7 tokens, the last 2 of one sample masked), its run with
    sequence parallelism off on one rank, and the error for heads that do not divide."""
    from litegen.parallel.sequence import sequence_parallel_off

    tokens = torch.randn(2, 7, 4, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    reference = CustomDiT()
    expected = reference(tokens, valid).pow(2).mean()
    expected.backward()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        gen = gen_for(tmp, 2)
        model = gen.prepare(CustomDiT())
        loss = model(tokens, valid).pow(2).mean()
        loss.backward()
        grads = {n: p.grad for n, p in gen.unwrap(model).named_parameters()}
        out["step"] = {
            "loss": (loss.item(), expected.item()),
            "grads": {n: (grads[n], p.grad) for n, p in reference.named_parameters()},
        }
        if dist.get_rank() == 0:  # alone: a collective here would wait for rank 1 forever
            sampler = copy.deepcopy(gen.unwrap(model))  # say, for sampling on one rank
            with torch.no_grad(), sequence_parallel_off(sampler):
                out["off"] = (sampler(tokens, valid), reference(tokens, valid).detach())
        try:
            gen.prepare(CustomDiT(heads=4, dim=12))  # 4 heads at sp = 2 divide; 3 do not
            gen.prepare(CustomDiT(heads=3, dim=12))
        except ValueError as err:
            out["error"] = str(err)
    return out


# -- inside the ranks ---------------------------------------------------------------------------
def gen_for(tmp: str, sp: int, strategy: str = "ddp", steps: int = STEPS, **fields):
    import litegen
    from litegen.utils.config import MainConfig

    optimization = fields.pop("optimization", {})
    trainer = {"log_every": 1, "save_final": False} | fields.pop("trainer", {})
    parallel = {"strategy": strategy, "sp_size": sp}
    config = {
        "runtime": {"device": "cpu"},
        "results_dir": tmp,
        "checkpoint_dir": f"{tmp}/ckpt",
        "global_batch_size": GLOBAL_BATCH,
        "max_steps": steps,
        "trainer": trainer,
        "optimization": optimization | {"parallel": parallel},
    }
    return litegen.initialize(MainConfig.from_dict(config | fields))


def one_step(name: str, sp: int) -> dict:
    """Loss and gradients at ``sp`` (through prepare, ddp) and of one process, whole batch."""
    spec = REAL_MODELS[name]
    heads = max(sp, 2)
    batch = batch_of(name, heads, batch_size=2)
    reference = spec.build("tiny", **config_of(name, heads))
    expected = spec.loss(reference, batch)
    expected.backward()
    with tempfile.TemporaryDirectory() as tmp:
        gen = gen_for(tmp, sp)
        model = gen.prepare(spec.build("tiny", **config_of(name, heads)))
        loss = spec.loss(model, batch)
        loss.backward()
    grads = {n: p.grad for n, p in gen.unwrap(model).named_parameters()}
    return {
        "loss": (loss.item(), expected.item()),
        "grads": {n: (grads[n], p.grad) for n, p in reference.named_parameters()},
    }


class Samples(torch.utils.data.Dataset):
    """A model's synthetic batch, one sample (a dict of tensors) per index."""

    collate_fn = staticmethod(torch.utils.data.default_collate)

    def __init__(self, name: str, heads: int, n: int = 16) -> None:
        self.batch = batch_of(name, heads, n, seed=2)

    def __len__(self) -> int:
        return len(self.batch["latents"])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.batch.items()}


def train(tmp: str, sp: int, strategy: str = "ddp", name: str = "wan", **fields) -> dict:
    """A few SGD steps of a tiny model through the real loop; losses and weights back."""
    from litegen.trainer import Trainer

    spec, heads = REAL_MODELS[name], 2
    gen = gen_for(tmp, sp, strategy, **fields)
    model = spec.build("tiny", **config_of(name, heads))
    # SGD: see the module docstring.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    model, optimizer, loader = gen.prepare(model, optimizer, Samples(name, heads))
    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    losses = Trainer(gen, lambda batch, model: spec.loss(model, batch), parts).fit()
    result = {"losses": losses, "weights": gen.full_model_state(model)}
    if gen.ema is not None:
        result["ema"] = gen.full_ema_state()
    return result


def compiled(tmp: str, sp: int) -> dict:
    """Wan with compiled, checkpointed blocks (aot_eager: Dynamo and AOTAutograd, no C++)."""
    import litegen.compile

    real = litegen.compile.compile_blocks
    litegen.compile.compile_blocks = functools.partial(real, backend="aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        optimization = {"compile": {"enabled": True}, "memory": CHECKPOINT}
        result = train(tmp, sp, optimization=optimization)
    finally:
        litegen.compile.compile_blocks = real
    result["graph_breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return result


def fused_wan_attention(tmp: str, sp: int) -> dict:
    """Wan with ``optimization.experimental.fused_wan_attention`` (on any torch, for the test)."""
    from litegen import experimental
    from litegen.experimental import wan_attention

    experimental.TESTED_TORCH["fused_wan_attention"] = (experimental.torch_release(),)
    real, swapped = wan_attention.apply_fused_wan_attention, []
    wan_attention.apply_fused_wan_attention = lambda model: (
        swapped.append(real(model)) or swapped[-1]
    )
    try:
        result = train(tmp, sp, optimization={"experimental": {"fused_wan_attention": True}})
    finally:
        wan_attention.apply_fused_wan_attention = real
    return result | {"swapped": swapped}


def collectives() -> dict:
    """The all-to-alls and the gather against their definitions, forward and backward."""
    from litegen.parallel.sequence.comm import gather, heads_to_seq, seq_to_heads

    group, n, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    whole = torch.randn(2, 4, 6, 3, generator=torch.Generator().manual_seed(0))  # (B, H, S, D)
    mine = whole.chunk(n, dim=2)[rank].clone().requires_grad_()
    heads = seq_to_heads(mine, group)
    upstream = torch.randn(heads.shape, generator=torch.Generator().manual_seed(1 + rank))
    heads.backward(upstream)
    # Every rank's upstream gradient, to compute the adjoint by hand.
    upstreams = [
        torch.randn(heads.shape, generator=torch.Generator().manual_seed(1 + r)) for r in range(n)
    ]
    gathered_x = mine.detach().clone().requires_grad_()
    gathered = gather(gathered_x, 2, group)
    gathered.backward(whole * (rank + 1))
    return {
        "to heads": (heads.detach(), whole.chunk(n, dim=1)[rank]),
        "round trip": (heads_to_seq(heads.detach(), group), mine.detach()),
        # The backward of seq_to_heads sends each rank's gradient back to the tokens' owner.
        "to heads backward": (mine.grad, torch.cat(upstreams, dim=1).chunk(n, dim=2)[rank]),
        "gather": (gathered.detach(), whole),
        # The backward of a gather sums every rank's gradient of this rank's part.
        "gather backward": (gathered_x.grad, sum(range(1, n + 1)) * whole.chunk(n, dim=2)[rank]),
    }


def two_ranks(tmp: str) -> dict:
    out = {f"sp2/{name}": one_step(name, 2) for name in MODELS}
    out["collectives"] = collectives()
    out["custom"] = custom_cases()
    offload = {"memory": CHECKPOINT | {"activation_offload": True}}
    # sp = 1 (dp = 2) straight, and sp = 2 (dp = 1) stopped at step 2 then resumed at sp = 1.
    out["dp2"] = train(f"{tmp}/dp2", 1, trainer={"checkpoint_every": 2})
    out["sp2"] = train(f"{tmp}/sp2", 2, trainer={"checkpoint_every": 2}, optimization=offload)
    for sp, source in ((1, "sp2"), (2, "dp2")):
        out[f"resume {source} at sp{sp}"] = train(
            f"{tmp}/resume{sp}", sp, trainer={"resume_run": f"{tmp}/{source}/ckpt/step_2"}
        )
    out["sp2/zero1"] = train(f"{tmp}/zero1", 2, "zero1")
    # Selective checkpointing: the all-to-alls run again in the recomputation.
    ops = {"activation_checkpoint": CHECKPOINT["activation_checkpoint"] | {"policy": "ops"}}
    out["sp2/zero2"] = train(f"{tmp}/zero2", 2, "zero2", optimization={"memory": ops})
    out["sp2/compile"] = compiled(f"{tmp}/compile", 2)
    out["sp2/fused_wan_attention"] = fused_wan_attention(f"{tmp}/fused_wan", 2)
    return out


def four_ranks(tmp: str) -> dict:
    out = {f"sp4/{name}": one_step(name, 4) for name in MODELS}
    # Gradient clipping on (the norm is of the averaged gradients, so it must match too).
    common = {"trainer": {"max_grad_norm": 0.5}}
    ema = {"ema": {"enable": True, "decay": 0.9}}
    out["dp4"] = train(f"{tmp}/dp4", 1, **common, **ema)
    checkpointed = {"optimization": {"memory": CHECKPOINT}}
    out["fsdp2 2x2"] = train(f"{tmp}/fsdp2", 2, "fsdp2", **checkpointed, **common, **ema)
    out["hsdp 2x2"] = train(f"{tmp}/hsdp", 2, "hsdp", **common)
    return out


# -- the tests ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(two_ranks, 2, str(tmp_path_factory.mktemp("sp2")))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    # Two simulated nodes of 2 ranks: each sequence-parallel group is one node (hsdp needs 2).
    return run_ranks(four_ranks, 4, str(tmp_path_factory.mktemp("sp4")), local_world_size=2)


def assert_same_step(result: dict) -> None:
    loss, expected = result["loss"]
    assert loss == pytest.approx(expected, rel=1e-6)
    scale = max(ref.abs().max().item() for _, ref in result["grads"].values())
    for name, (grad, ref) in result["grads"].items():
        # Relative to the largest gradient: the key biases' true gradient is zero (softmax
        # ignores a shift), so theirs is rounding noise on any layout.
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5 * scale, msg=name)


def assert_same_run(result: dict, expected: dict, first_step: int = 0) -> None:
    """Same losses from ``first_step`` on, and the same final weights."""
    assert len(result["losses"]) == STEPS - first_step
    torch.testing.assert_close(result["losses"], expected["losses"][first_step:], **TOLERANCE)
    for name, value in expected["weights"].items():
        torch.testing.assert_close(result["weights"][name], value, **TOLERANCE, msg=name)


@pytest.mark.parametrize("name", MODELS)
def test_sp2_step_equals_one_process(two, name):
    for rank in two:
        assert_same_step(rank[f"sp2/{name}"])


@pytest.mark.parametrize("name", MODELS)
def test_sp4_step_equals_one_process(four, name):
    for rank in four:
        assert_same_step(rank[f"sp4/{name}"])


def test_sp2_training_with_checkpointing_and_offload_equals_dp2(two):
    assert_same_run(two[0]["sp2"], two[0]["dp2"])


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_sp2_under_zero_equals_dp2(two, strategy):
    assert_same_run(two[0][f"sp2/{strategy}"], two[0]["dp2"])


def test_sp2_compiled_blocks_equal_dp2_without_graph_breaks(two):
    result = two[0]["sp2/compile"]
    # One graph serves both blocks: neither the all-to-alls nor the attention class split it.
    assert result["graph_breaks"] == {} and result["graphs"] == 1
    assert_same_run(result, two[0]["dp2"])


@pytest.mark.parametrize(("source", "sp"), [("sp2", 1), ("dp2", 2)])
def test_resume_across_sequence_parallel_sizes(two, source, sp):
    assert_same_run(two[0][f"resume {source} at sp{sp}"], two[0][source], first_step=2)


def test_sp2_with_fused_wan_attention_equals_dp2(two):
    result = two[0]["sp2/fused_wan_attention"]
    assert result["swapped"] == [2]  # both tiny blocks' self-attention
    assert_same_run(result, two[0]["dp2"])


@pytest.mark.parametrize("run", ["fsdp2 2x2", "hsdp 2x2"])
def test_dp_times_sp_equals_dp_only(four, run):
    assert_same_run(four[0][run], four[0]["dp4"])


def test_ema_under_dp_times_sp_equals_dp_only(four):
    for name, value in four[0]["dp4"]["ema"].items():
        torch.testing.assert_close(four[0]["fsdp2 2x2"]["ema"][name], value, **TOLERANCE)


def test_collectives_match_their_definitions(two):
    for rank in two:
        for name, (value, expected) in rank["collectives"].items():
            torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=name)


def test_custom_plan_with_a_key_mask_and_padding_equals_one_process(two):
    for rank in two:
        assert_same_step(rank["custom"]["step"])


def test_a_copy_runs_whole_sequences_on_one_rank_with_sequence_parallel_off(two):
    value, expected = two[0]["custom"]["off"]
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7)


def test_heads_that_do_not_divide_are_an_error_at_prepare(two):
    message = two[0]["custom"]["error"]
    assert "sp_size=2 must divide the attention heads of CustomDiT" in message
    assert "blocks.0.attn has 3" in message


def test_builtin_plans_split_what_diffusers_context_parallel_plans_split():
    """Wan and LTX-Video carry diffusers' own plans: the video-token entries must agree (the
    text stays whole in LiteGen's, see litegen.parallel.sequence.builtin_plans)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    for cls, text in (
        (diffusers.WanTransformer3DModel, set()),
        (diffusers.LTXVideoTransformer3DModel, {"encoder_hidden_states", "encoder_attention_mask"}),
    ):
        ours = (BUILTIN | family_plans())[cls.__name__](None)
        theirs: dict[tuple[str, str | int], int] = {}
        gathers: dict[str, int] = {}
        for path, entry in cls._cp_plan.items():
            if isinstance(entry, ContextParallelOutput):
                gathers[path] = entry.gather_dim
                continue
            for key, split in entry.items():
                assert isinstance(split, ContextParallelInput)
                if key not in text and split.expected_dims != 2:  # 2-D: a per-token timestep
                    theirs[(path, key)] = split.split_dim
        mine = {
            (path, key): Split(spec).dim if isinstance(spec, int) else spec.dim
            for table in (ours.split_inputs, ours.split_outputs)
            for path, entries in table.items()
            for key, spec in entries.items()
            if not (isinstance(spec, Split) and spec.ndim == 2)
        }
        assert mine == theirs, cls.__name__
        assert dict(ours.gather_outputs) == gathers, cls.__name__
