"""Samples and validation during training: their steps, the EMA weights, no effect on training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import litegen
from litegen.trainer import Trainer, save_samples
from litegen.utils.config import MainConfig

DECAY = 0.9


@pytest.fixture(autouse=True)
def _own_process_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def pairs(n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, generator=gen), torch.randn(2, generator=gen)) for _ in range(n)]


def fit(tmp_path, *, sample_fn=None, validate_fn=None, step_fn=None, **trainer) -> dict:
    """Four steps of a linear model with an EMA; the train_step draws noise from the RNG."""
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": str(tmp_path / "results"),
            "global_batch_size": 4,
            "max_steps": 4,
            "ema": {"enable": True, "decay": DECAY},
            "trainer": {"log_every": 1, "save_final": False, **trainer},
        }
    )
    gen = litegen.initialize(config)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, loader = gen.prepare(model, optimizer, pairs())
    seen: list[dict[str, torch.Tensor]] = []  # the weights each train_step starts from

    def train_step(batch, model):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        data, target = batch
        noisy = data + 0.1 * torch.randn_like(data)
        return nn.functional.mse_loss(model(noisy), target)

    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    trainer_ = Trainer(
        gen, step_fn or train_step, parts, sample_fn=sample_fn, validate_fn=validate_fn
    )
    losses = trainer_.fit()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    records = [json.loads(x) for x in (tmp_path / "results" / "metrics.jsonl").open()]
    return {"losses": losses, "seen": seen, "final": final, "records": records}


def test_samples_come_at_their_steps_from_the_ema_weights_and_change_no_loss(tmp_path):
    views = {}

    def sample(model, step, out_dir):
        assert not model.training and not torch.is_grad_enabled()
        views[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return torch.rand(3, 3, 6, 6)  # draws from the RNG the training noise comes from

    with_samples = fit(tmp_path / "a", sample_fn=sample, sample_every=2)
    without = fit(tmp_path / "b")

    assert with_samples["losses"] == without["losses"]
    for key in without["final"]:
        assert torch.equal(with_samples["final"][key], without["final"][key])
    samples = tmp_path / "a" / "results" / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step_2", "step_4"]
    assert sorted(views) == [2, 4]
    # Three 6x6 images: a 2x2 grid with 2-pixel gaps.
    assert Image.open(samples / "step_2" / "samples.png").size == (2 * 8 + 2, 2 * 8 + 2)

    # The EMA computed directly from the weights after each step (what step k+1 starts from).
    after = [*with_samples["seen"][1:], with_samples["final"]]
    ema = {k: v.clone() for k, v in with_samples["seen"][0].items()}
    for step, weights in enumerate(after, start=1):
        for key in ema:
            ema[key] = DECAY * ema[key] + (1 - DECAY) * weights[key]
        if step in views:
            for key in ema:
                torch.testing.assert_close(views[step][key], ema[key])
                assert not torch.equal(views[step][key], weights[key])


def test_validation_loss_is_logged_at_its_steps_even_between_log_lines(tmp_path):
    returned = {}

    def validate(model, step):
        held_out = torch.ones(3, 4)
        returned[step] = nn.functional.mse_loss(model(held_out), torch.zeros(3, 2))
        return returned[step]

    run = fit(tmp_path, validate_fn=validate, validate_every=2, log_every=3)
    logged = {r["step"]: r.get("val_loss") for r in run["records"]}
    assert sorted(logged) == [2, 3, 4]
    assert logged[3] is None
    for step in (2, 4):
        assert logged[step] == pytest.approx(float(returned[step]))


def test_a_sample_interval_without_a_sample_hook_fails_before_training(tmp_path):
    def step_fn(batch, model):
        raise AssertionError("training started")

    with pytest.raises(ValueError, match=r"trainer.sample_every is 2 .*define sample"):
        fit(tmp_path, step_fn=step_fn, sample_every=2)


def test_videos_become_an_mp4_grid_and_images_in_minus_one_to_one_a_png(tmp_path):
    av = pytest.importorskip("av")
    videos = torch.zeros(2, 3, 5, 4, 4)
    videos[1, 0] = 1.0  # the second clip red, the first black
    mp4 = save_samples(videos * 2 - 1, tmp_path / "video")[0]
    assert mp4.name == "samples.mp4"
    with av.open(str(mp4)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (8, 14, 3)  # 2 clips of 4x4, padded by 2
    assert frames[2][3, 3].max() < 40 and frames[2][3, 9, 0] > 200  # black, then red
    png = save_samples([-torch.ones(1, 4, 4)], tmp_path / "image")[0]
    assert np.asarray(Image.open(png)).max() == 0  # -1 is black
    with pytest.raises(ValueError, match=r"sample\(\) returned shape \(2, 4\)"):
        save_samples(torch.zeros(2, 4), tmp_path)


@pytest.mark.parametrize("kind", ["png", "mp4", "gif"])
def test_a_sample_write_failing_midway_keeps_the_earlier_file(tmp_path, monkeypatch, kind):
    from PIL import Image as PILImage

    from litegen.trainer import sample_files as media

    if kind == "mp4":
        pytest.importorskip("av")
    else:
        monkeypatch.setattr(media, "mp4_available", lambda: False)
    samples = torch.rand(2, 3, 8, 8) if kind == "png" else torch.rand(2, 3, 3, 8, 8)
    (first,) = save_samples(samples, tmp_path)
    assert first.name == f"samples.{kind}"
    earlier = first.read_bytes()

    def half_written(path):
        with open(path, "wb") as handle:  # a disk that fills up, a kill: some bytes, then out
            handle.write(earlier[:10])
        raise OSError("No space left on device")

    monkeypatch.setattr(media, "_write_mp4", lambda grids, path: half_written(path))
    monkeypatch.setattr(PILImage.Image, "save", lambda image, path, **kw: half_written(path))
    with pytest.raises(OSError, match="No space"):
        save_samples(samples, tmp_path)
    assert first.read_bytes() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]


def test_videos_become_a_gif_without_an_h264_encoder(tmp_path, monkeypatch):
    from litegen.trainer import sample_files as media

    monkeypatch.setattr(media, "MP4_CODEC", "no-such-encoder")
    gif = save_samples(torch.rand(2, 3, 5, 4, 4), tmp_path)[0]
    with Image.open(gif) as picture:
        assert (picture.format, picture.n_frames, picture.size) == ("GIF", 5, (14, 8))


def test_launch_refuses_a_sample_interval_without_the_hook_before_building_anything():
    from pathlib import Path

    from litegen.trainer import run_entry

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    config = MainConfig.from_dict({"runtime": {"device": "cpu"}, "trainer": {"sample_every": 5}})
    with pytest.raises(ValueError, match=r"trainer.sample_every is 5 .*trainer.sample_every: 0"):
        run_entry(config, "resume_entry.py", fixtures)
    assert not torch.distributed.is_initialized()  # failed before initialize()
