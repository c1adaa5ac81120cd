"""The fine-tuning comparator's shapes and table (scripts/bench/finetune_vs_hand.py,
hand_lora_loop.py): both sides train the recipe's bucket, and the table's ratios are over the
reference side's median. The GPU runs themselves are the lead's (docs/performance.md)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from scripts.bench.finetune_vs_hand import bucket, parse_args, shape_key, summary, table
from scripts.bench.hand_lora_loop import FluxInputs, WanInputs


def test_the_video_default_is_wan_1_3b_at_640x352x49_with_11440_tokens():
    args = parse_args([])
    assert (args.rank, args.resolution) == (32, 480)
    assert bucket(args) == (49, 352, 640)
    wan = SimpleNamespace(
        config=SimpleNamespace(in_channels=16, text_dim=4096, patch_size=(1, 2, 2))
    )
    inputs = WanInputs(wan, 1, 49, 352, 640, 512)
    assert inputs.tokens == 11440
    assert inputs.text_shape == (1, 512, 4096)


def test_the_image_default_is_flux_at_1024_square_with_4096_tokens():
    args = parse_args(["--family", "flux"])
    assert (args.rank, args.frames) == (16, 1)
    assert bucket(args) == (1, 1024, 1024)
    config = SimpleNamespace(
        in_channels=64, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True
    )
    inputs = FluxInputs(SimpleNamespace(config=config), 1, 1, 1024, 1024, 512)
    assert inputs.tokens == 4096
    assert inputs.latent_shape == (1, 16, 128, 128)


def test_the_table_gives_each_side_its_median_and_ratio(tmp_path):
    args = parse_args(["--work", str(tmp_path)])
    args.work = tmp_path
    runs = [("hand-compiled", 3.0), ("launch", 2.7), ("launch", 3.3), ("hand-compiled", 2.0)]
    runs.append(("other shape", 9.0))
    lines = [
        {
            "side": side,
            "samples_per_s": rate,
            "peak_gib": 20.0 + i,
            "shape": "k",
            "device": "H100",
            "torch": "2.11",
        }
        for i, (side, rate) in enumerate(runs)
    ]
    lines[-1]["shape"] = "elsewhere"
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = summary(args, "k")
    assert set(result["sides"]) == {"hand-compiled", "launch"}
    assert result["sides"]["launch"]["median"] == pytest.approx(3.0)
    assert result["sides"]["launch"]["ratio"] == pytest.approx(3.0 / 2.5)
    assert result["sides"]["launch"]["peak_gib"] == 22.0
    assert "launch               2.700 3.300" in table(result)


def test_profiled_runs_are_tabled_apart_and_their_steps_must_run(monkeypatch):
    monkeypatch.setenv("LITEGEN_PROFILE_STEPS", "unset")  # restored after the test
    plain = parse_args([])
    profiled = parse_args(["--profile", "31,34"])
    shape = bucket(plain)
    assert shape_key(profiled, shape) == shape_key(plain, shape) + " profiled"
    assert os.environ["LITEGEN_PROFILE_STEPS"] == "31,34"  # what the profiled entry reads
    with pytest.raises(SystemExit):
        parse_args(["--profile", "31,42"])  # 40 steps run by default
