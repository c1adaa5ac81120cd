"""Planning ``sp_size x cp_size``: which layouts a model's heads allow, what each communicates,
and ``inspect-config --estimate`` showing them and refusing a Ulysses size the heads forbid."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from litegen.parallel.sequence.layouts import AttentionShape, recommended, sequence_layouts
from litegen_cli.app import app

# Wan 2.1 1.3B: 30 blocks whose self-attention has 12 heads of 128.
WAN_1_3B = [AttentionShape(f"blocks.{i}.attn1", heads=12, hidden=1536) for i in range(30)]
DRY_RUN = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "sp_dry_run.yaml"


def test_wan_1_3b_on_8_ranks_is_ulysses_4_times_ring_2():
    layouts = sequence_layouts(WAN_1_3B, ranks=8, tokens=32760)
    assert [(x.sp, x.cp, x.ok) for x in layouts] == [
        (8, 1, False),
        (4, 2, True),
        (2, 4, True),
        (1, 8, True),
    ]
    assert layouts[0].problem == "sp_size 8 does not divide the 12 heads of blocks.0.attn1"
    best = recommended(layouts)
    assert (best.sp, best.cp) == (4, 2)
    # Every layout gives a rank 32760 / 8 tokens; they differ in what attention moves.
    assert {x.tokens_per_rank for x in layouts} == {4095}


def test_communication_per_step_follows_the_all_to_alls_and_the_ring_passes():
    shape = AttentionShape("attn", heads=4, hidden=64)
    by_layout = {(x.sp, x.cp): x for x in sequence_layouts([shape], 4, tokens=400, batch=2)}
    unit = 2 * 100 * 64  # batch x tokens per rank x hidden
    # Ulysses: q, k, v, out and their gradients, (sp - 1) / sp of each leaves the rank.
    assert by_layout[4, 1].ulysses_elements == 8 * unit * 3 // 4
    assert by_layout[4, 1].ring_elements == 0
    # Ring of 4: k and v 3 times forward and backward, their gradients 4 times.
    assert by_layout[1, 4].ring_elements == (2 * 3 + 2 * 3 + 2 * 4) * unit
    assert by_layout[2, 2].ulysses_elements == 8 * unit // 2
    assert by_layout[2, 2].ring_elements == 8 * unit


def test_unknown_length_leaves_tokens_and_communication_out():
    (layout,) = sequence_layouts([AttentionShape("attn", 2, 8)], ranks=1)
    assert layout.tokens_per_rank is None and layout.ulysses_elements is None


def test_inspect_config_estimate_refuses_sp_that_does_not_divide_the_heads(tmp_path):
    # The tiny Wan has 2 heads: Ulysses 4 cannot split it, Ulysses 2 x ring 2 can.
    args = ["launch.nproc_per_node=4", "optimization.parallel.sp_size=4"]
    result = CliRunner().invoke(
        app, ["inspect-config", str(DRY_RUN), *args, "--estimate"], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 2, result.output
    assert "Sequence layouts of WanTransformer3DModel over 4 ranks per sample" in result.output
    assert "recommended" in result.output
    assert (
        "field 'optimization.parallel.sp_size': sp_size 4 does not divide the 2 heads of "
        "blocks.0.attn1 of WanTransformer3DModel; use sp_size: 2, cp_size: 2" in result.output
    )


def estimate(*overrides: str):
    from litegen_cli.estimate import estimate_recipe
    from litegen_cli.recipe import load_recipe

    shape = ("global_batch_size=1", "model.frames=8", "model.height=16", "model.width=16")
    return estimate_recipe(load_recipe(DRY_RUN, [*shape, *overrides]))


def test_the_estimate_counts_one_ranks_share_of_the_sequence():
    whole = estimate("launch.nproc_per_node=1", "optimization.parallel.sp_size=1")
    ulysses = estimate("launch.nproc_per_node=2", "optimization.parallel.sp_size=2")
    ring = estimate(
        "launch.nproc_per_node=2",
        "optimization.parallel.sp_size=1",
        "optimization.parallel.cp_size=2",
    )
    # 512 tokens, half a rank's: the blocks' activations halve, beside what is not split.
    assert ring.activations == ulysses.activations
    assert 0.4 * whole.activations < ulysses.activations < 0.6 * whole.activations


def test_one_ranks_share_runs_joint_attention_with_its_mask_cut_to_its_keys():
    """HunyuanVideo's mask covers [video, text]: one rank's share attends its video and the text."""
    import torch

    from litegen.parallel.sequence import plan_for
    from litegen.parallel.sequence.apply import one_rank_share
    from litegen_zoo.real_models import REAL_MODELS

    spec = REAL_MODELS["hunyuan_video"]
    model = spec.build("tiny")
    batch = spec.batch("tiny", 1, 0, None, spec.config("tiny"))
    whole = spec.loss(model, batch)
    one_rank_share(model, plan_for(model), 2)
    share = spec.loss(model, batch)  # the share's output, padded back: a finite loss
    assert torch.isfinite(share) and share.shape == whole.shape


def test_inspect_config_estimate_refuses_cp_for_a_model_without_a_sequence_plan():
    args = ["launch.nproc_per_node=2", "model.name=sd3"]
    args += ["optimization.parallel.sp_size=1", "optimization.parallel.cp_size=2"]
    result = CliRunner().invoke(
        app, ["inspect-config", str(DRY_RUN), *args, "--estimate"], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 2, result.output
    assert "needs a sequence-parallel plan for SD3Transformer2DModel" in result.output
