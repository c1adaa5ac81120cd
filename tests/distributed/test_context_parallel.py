"""Context parallelism (ring attention, ``cp_size``) on gloo CPU ranks: cp > 1, alone and with
Ulysses (``sp_size x cp_size``), computes what one process computes.

- The ring primitive against ``F.scaled_dot_product_attention`` on the whole sequence: output
  and the gradients of query, key and value, with chunks that carry padding, a key mask, and
  keys every rank holds whole (text).
- Diffusers' Wan, LTX-Video, HunyuanVideo and Flux at their tiny sizes: one step at
  ``cp_size=2`` (2 ranks) and at ``sp_size=2 x cp_size=2`` (4 ranks) gives the loss and the
  gradients of one process on the whole batch, with token counts that do not divide by the
  group (padding). Flux has no LiteGen plan: it runs on the plan read from diffusers'
  ``_cp_plan`` (the text left whole).
- Training through the real loop equals dp only: ``cp_size=2`` under ddp with checkpointing,
  ``sp_size=2 x cp_size=2`` under fsdp2, ``cp_size=2`` under hsdp (two simulated nodes); and a
  run checkpoint written at ``cp_size=2`` resumes exactly at ``cp_size=1`` and the reverse.
- Compiled, checkpointed blocks at ``cp_size=2`` (aot_eager) train as dp only.
- A sequence too short for the ring (a rank would hold padding only) is refused by name.

fp32 throughout: the ring changes only the order of sums (tolerances as in
test_sequence_parallel.py).
"""

from __future__ import annotations

import tempfile

import diffusers
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from litegen_zoo.real_models import REAL_MODELS, LatentShape
from tests.distributed.harness import run_ranks
from tests.distributed.test_sequence_parallel import (
    SHAPES,
    Samples,
    assert_same_run,
    assert_same_step,
    config_of,
)

pytestmark = pytest.mark.slow

MODELS = ("wan", "ltx_video", "hunyuan_video", "flux")
# Token counts that leave padding at cp 2 or at sp 2 x cp 2: Wan 6, LTX-Video 9, HunyuanVideo
# 3, Flux 9 (3 x 3 packed latent patches).
CP_SHAPES = SHAPES | {"flux": LatentShape(6, 6, frames=1, text_tokens=6)}
MODEL_CLASSES = [getattr(diffusers, REAL_MODELS[name].class_name) for name in MODELS]
STEPS = 4
GLOBAL_BATCH = 4


def gen_for(tmp: str, sp: int, cp: int, strategy: str = "ddp", steps: int = STEPS, **fields):
    import litegen
    from litegen.utils.config import MainConfig

    optimization = fields.pop("optimization", {})
    trainer = {"log_every": 1, "save_final": False} | fields.pop("trainer", {})
    parallel = {"strategy": strategy, "sp_size": sp, "cp_size": cp}
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


def batch_of(name: str, heads: int, batch_size: int) -> dict:
    spec = REAL_MODELS[name]
    config = spec.config("tiny") | config_of(name, heads)
    return spec.batch("tiny", batch_size, 1, CP_SHAPES.get(name), config)


def ring_primitive() -> dict:
    """Ring attention over the world against SDPA on the whole sequence: 2 queries' heads,
    a sequence of 7 split tokens (padded to 8), 3 text keys every rank holds, a key mask."""
    from litegen.parallel.sequence.ring import (
        RingSpec,
        additive_mask,
        chunk_lengths,
        chunk_masks,
        ring_attention,
    )

    group, n, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    length, text = 7, 3
    q, k, v = (torch.randn(2, 2, length + text, 4, generator=gen) for _ in range(3))
    keep = torch.ones(2, 1, 1, length + text, dtype=torch.bool)
    keep[1, ..., -1] = False  # the last text key of the second sample
    upstream = torch.randn(2, 2, length + text, 4, generator=gen)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, attn_mask=keep)
    expected.backward(upstream)

    chunk = -(-length // n)
    lengths = chunk_lengths(length, chunk, n)
    padded = [F.pad(t[:, :, :length], (0, 0, 0, chunk * n - length)) for t in (q, k, v)]
    mine = [t[:, :, rank * chunk : (rank + 1) * chunk].clone().requires_grad_() for t in padded]
    texts = [t[:, :, length:].clone().requires_grad_() for t in (q, k, v)]
    mask = additive_mask(keep, q.dtype)
    spec = RingSpec(group, lengths, chunk_masks(mask, 0, chunk, lengths), mask[..., length:])
    query = torch.cat([mine[0], texts[0]], dim=2)
    out = ring_attention(query, mine[1], mine[2], spec, texts[1], texts[2])
    rows = slice(rank * chunk, rank * chunk + lengths[rank])
    # Every rank computes the text queries' output whole: each takes 1/n of their upstream, so
    # that the gradients summed over the ring are those of one process.
    video_grad = F.pad(upstream[:, :, rows], (0, 0, 0, chunk - lengths[rank]))
    out.backward(torch.cat([video_grad, upstream[:, :, length:] / n], dim=2))
    real = lengths[rank]
    text_grads = [t.grad.clone() for t in texts]
    for g in text_grads:
        dist.all_reduce(g)
    return {
        "out video": (out[:, :, :real].detach(), expected[:, :, rows].detach()),
        "out text": (out[:, :, chunk:].detach(), expected[:, :, length:].detach()),
        **{
            f"grad {name}": (t.grad[:, :, :real], w.grad[:, :, rows])
            for name, t, w in zip("qkv", mine, whole, strict=True)
        },
        **{
            f"grad text {name}": (g, w.grad[:, :, length:])
            for name, g, w in zip("qkv", text_grads, whole, strict=True)
        },
    }


def one_step(name: str, sp: int, cp: int) -> dict:
    """Loss and gradients at ``sp x cp`` (through prepare, ddp) and of one process."""
    spec = REAL_MODELS[name]
    heads = max(sp, 2)
    batch = batch_of(name, heads, batch_size=2)
    reference = spec.build("tiny", **config_of(name, heads))
    expected = spec.loss(reference, batch)
    expected.backward()
    with tempfile.TemporaryDirectory() as tmp:
        gen = gen_for(tmp, sp, cp)
        model = gen.prepare(spec.build("tiny", **config_of(name, heads)))
        loss = spec.loss(model, batch)
        loss.backward()
    grads = {n: p.grad for n, p in gen.unwrap(model).named_parameters()}
    return {
        "loss": (loss.item(), expected.item()),
        "grads": {n: (grads[n], p.grad) for n, p in reference.named_parameters()},
    }


def train(tmp: str, sp: int, cp: int, strategy: str = "ddp", **fields) -> dict:
    """A few SGD steps of the tiny Wan through the real loop; losses and weights back."""
    from litegen.trainer import Trainer

    spec, heads = REAL_MODELS["wan"], 2
    gen = gen_for(tmp, sp, cp, strategy, **fields)
    model = spec.build("tiny", **config_of("wan", heads))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    model, optimizer, loader = gen.prepare(model, optimizer, Samples("wan", heads))
    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    losses = Trainer(gen, lambda batch, model: spec.loss(model, batch), parts).fit()
    return {"losses": losses, "weights": gen.full_model_state(model)}


def too_short() -> str:
    """On a ring of 4, 7 tokens pad to 8 (the last rank holds 1); 5 would leave it none."""
    from litegen.parallel.sequence import SequencePlan

    class Tiny(torch.nn.Module):
        litegen_sp_plan = SequencePlan(
            split_inputs={"": {"x": 1}}, gather_outputs={"head": 1}, attention={}
        )

        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.head(x)

    with tempfile.TemporaryDirectory() as tmp:
        gen = gen_for(tmp, 1, 4)
        model = gen.prepare(Tiny())
        model(torch.zeros(1, 7, 4))
        try:
            model(torch.zeros(1, 5, 4))
        except ValueError as err:
            return str(err)
    return ""


def compiled(tmp: str) -> dict:
    """cp 2 with compiled, checkpointed blocks (aot_eager): the ring runs between graphs."""
    import functools

    import litegen.compile

    real = litegen.compile.compile_blocks
    litegen.compile.compile_blocks = functools.partial(real, backend="aot_eager")
    torch._dynamo.reset()
    try:
        memory = {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.0}}
        return train(tmp, 1, 2, optimization={"compile": {"enabled": True}, "memory": memory})
    finally:
        litegen.compile.compile_blocks = real


def two_ranks(tmp: str) -> dict:
    out = {f"cp2/{name}": one_step(name, 1, 2) for name in MODELS}
    out["ring"] = ring_primitive()  # on the process group the steps started
    checkpointed = {"memory": {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.0}}}
    out["dp2"] = train(f"{tmp}/dp2", 1, 1, trainer={"checkpoint_every": 2})
    out["cp2"] = train(
        f"{tmp}/cp2", 1, 2, trainer={"checkpoint_every": 2}, optimization=checkpointed
    )
    for cp, source in ((1, "cp2"), (2, "dp2")):
        out[f"resume {source} at cp{cp}"] = train(
            f"{tmp}/resume{cp}", 1, cp, trainer={"resume_run": f"{tmp}/{source}/ckpt/step_2"}
        )
    out["cp2/compile"] = compiled(f"{tmp}/compile")
    return out


def four_ranks(tmp: str) -> dict:
    out = {f"sp2xcp2/{name}": one_step(name, 2, 2) for name in MODELS}
    out["ring"] = ring_primitive()
    out["dp4"] = train(f"{tmp}/dp4", 1, 1)
    out["fsdp2 sp2xcp2"] = train(f"{tmp}/fsdp2", 2, 2, "fsdp2")
    out["hsdp cp2"] = train(f"{tmp}/hsdp", 1, 2, "hsdp")  # a ring per simulated node
    out["too short"] = too_short()
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(two_ranks, 2, str(tmp_path_factory.mktemp("cp2")))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    # Two simulated nodes of 2 ranks (hsdp needs 2).
    return run_ranks(four_ranks, 4, str(tmp_path_factory.mktemp("cp4")), local_world_size=2)


def assert_ring(result: dict) -> None:
    for name, (value, expected) in result.items():
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_ring_attention_matches_sdpa_on_two_ranks(two):
    for rank in two:
        assert_ring(rank["ring"])


def test_ring_attention_matches_sdpa_on_four_ranks(four):
    for rank in four:
        assert_ring(rank["ring"])


@pytest.mark.parametrize("name", MODELS)
def test_cp2_step_equals_one_process(two, name):
    for rank in two:
        assert_same_step(rank[f"cp2/{name}"])


@pytest.mark.parametrize("name", MODELS)
def test_sp2_x_cp2_step_equals_one_process(four, name):
    for rank in four:
        assert_same_step(rank[f"sp2xcp2/{name}"])


def test_cp2_training_with_checkpointing_equals_dp2(two):
    assert_same_run(two[0]["cp2"], two[0]["dp2"])


def test_cp2_with_compiled_blocks_equals_dp2(two):
    assert_same_run(two[0]["cp2/compile"], two[0]["dp2"])


@pytest.mark.parametrize(("source", "cp"), [("cp2", 1), ("dp2", 2)])
def test_resume_across_context_parallel_sizes(two, source, cp):
    assert_same_run(two[0][f"resume {source} at cp{cp}"], two[0][source], first_step=2)


@pytest.mark.parametrize("run", ["fsdp2 sp2xcp2", "hsdp cp2"])
def test_data_parallel_times_context_parallel_equals_dp_only(four, run):
    assert_same_run(four[0][run], four[0]["dp4"])


def test_a_sequence_too_short_for_the_ring_is_refused(four):
    message = four[0]["too short"]
    assert "5 tokens, too few for 4 ranks with a ring of 4" in message
    assert "optimization.parallel.cp_size" in message


def test_flux_plan_read_from_diffusers_cp_plan_keeps_the_text_whole():
    from litegen.parallel.sequence import plan_for
    from litegen.parallel.sequence.sequence_plan import Split

    plan = plan_for(REAL_MODELS["flux"].build("tiny"))
    # diffusers splits encoder_hidden_states and txt_ids too; LiteGen leaves them whole.
    assert plan.split_inputs == {"": {"hidden_states": Split(1, 3), "img_ids": Split(0, 2)}}
    assert plan.gather_outputs == {"proj_out": 1}
    assert set(plan.attention.values()) == {"text_first"} and len(plan.attention) == 4
