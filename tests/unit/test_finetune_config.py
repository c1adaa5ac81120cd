"""The finetune section and the checks of litegen.finetune before any rank starts: typos and
ranges refused naming the field, the family's frame rule, settings that do not apply, bucket
feasibility from a scan that encodes nothing, absolute paths, bad captions, the LR schedule."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from litegen.config import ConfigError, MainConfig
from litegen.data import scan_media
from litegen_cli.app import app
from litegen_cli.recipe import load_recipe

pytest.importorskip("diffusers")
pytest.importorskip("av")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
VIDEO, IMAGE = RECIPES / "finetune_video.yaml", RECIPES / "finetune_image.yaml"


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.media import make_media_folder

    return make_media_folder(tmp_path_factory.mktemp("media"), images=2, videos=4, frames=9)


def inspect(recipe: Path, *overrides: str):
    result = CliRunner().invoke(
        app, ["inspect-config", str(recipe), "launch.nproc_per_node=1", *overrides],
        env={"COLUMNS": "300"},
    )  # fmt: skip
    return result.exit_code, result.output.replace("\n", " ")


def test_typos_and_ranges_are_refused_at_once_naming_each_field():
    code, out = inspect(VIDEO, "finetune.data.caption_dropuot=0.5", "finetune.data.caption_dropout=1.5",
                        "finetune.data.resolution=big", "finetune.pipline=x",
                        "finetune.lr_schedule.name=step", "finetune.data.encode_batch_size=0")  # fmt: skip
    assert code == 2
    for field in ("finetune.data.caption_dropuot", "finetune.data.caption_dropout",
                  "finetune.data.resolution", "finetune.pipline", "finetune.lr_schedule.name",
                  "finetune.data.encode_batch_size"):  # fmt: skip
        assert f"field '{field}'" in out, out
    assert "did you mean 'caption_dropout'?" in out and "did you mean 'pipeline'?" in out


def test_the_earlier_spellings_are_read_with_a_warning_and_their_typos_refused(media):
    from tests.pipelines import tiny_pipeline_folder

    raw = {"finetune": {"data": {"resolution": 64}}, "model": {"pretrained": "p", "depth": 2},
           "data": {"caption_dropout": 0.2}, "objective": {"weighting": "cosmap"}}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = MainConfig.from_dict(raw)
    assert config.finetune.pipeline == "p" and config.finetune.data.caption_dropout == 0.2
    assert config.finetune.data.resolution == 64 and config.finetune.objective.weighting == "cosmap"
    assert config.model.depth == 2 and "data" not in config  # the user's own field stays
    said = sorted(str(w.message) for w in caught if issubclass(w.category, FutureWarning))
    assert said == [
        "data.caption_dropout is deprecated: use finetune.data.caption_dropout",
        "model.pretrained is deprecated: use finetune.pipeline",
        "objective.weighting is deprecated: use finetune.objective.weighting",
    ]
    with pytest.raises(
        ConfigError, match=r"finetune.data.caption_dropuot.*did you mean 'caption_dropout'"
    ):
        MainConfig.from_dict({"finetune": {}, "data": {"caption_dropuot": 0.5}})
    # The CLI lists them with the recipe's warnings, and refuses the old spelling's typo.
    wan = [f"model.pretrained={tiny_pipeline_folder('wan')}", f"data.folder={media}",
           "global_batch_size=2", "data.max_frames=9"]  # fmt: skip
    code, out = inspect(VIDEO, *wan, "data.caption_dropout=0.1")
    assert (
        code == 0 and "data.caption_dropout is deprecated: use finetune.data.caption_dropout" in out
    )
    assert "model.pretrained is deprecated: use finetune.pipeline" in out
    code, out = inspect(VIDEO, *wan, "data.caption_dropuot=0.1")
    assert code == 2 and "field 'finetune.data.caption_dropuot'" in out


def test_paths_are_absolute_when_the_recipe_is_loaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_recipe(
        VIDEO, ["finetune.pipeline=models/wan", "finetune.data.folder=clips"]
    ).config
    assert config.finetune.pipeline == str(tmp_path / "models" / "wan")
    assert config.finetune.data.folder == str(tmp_path / "clips")
    assert config.finetune.data.cache_root == str(tmp_path / "cache" / "finetune")
    first = load_recipe(VIDEO, ["trainer.validation.conditions={image: [frames/a.png]}"]).config
    assert first.trainer.validation.conditions == {"image": [str(tmp_path / "frames" / "a.png")]}


def test_the_caption_bound_and_content_digest_reach_the_scan_and_the_cache_keys(media):
    from litegen.finetune.cache import media_cache_keys
    from litegen.finetune.media import media_dataset
    from litegen.finetune.pipeline import pipeline_family
    from tests.pipelines import tiny_pipeline_folder

    def config(*overrides: str):
        return load_recipe(VIDEO, [f"finetune.pipeline={tiny_pipeline_folder('wan')}",
                                   f"finetune.data.folder={media}", "finetune.data.max_frames=9",
                                   *overrides]).config  # fmt: skip

    plain = config()
    dataset = media_dataset(plain, pipeline_family(plain))
    short = config("finetune.data.max_caption_bytes=15")  # "a photo number 1" has 16 bytes
    assert {f.path.suffix for f in media_dataset(short, pipeline_family(short)).files} == {".mp4"}
    digest = config("finetune.data.cache_content_digest=true")
    assert media_cache_keys(plain, dataset)[:-1] != media_cache_keys(digest, dataset)[:-1]
    code, out = inspect(VIDEO, "finetune.data.max_caption_bytes=0",
                        "finetune.data.cache_content_digets=true")  # fmt: skip
    assert code == 2 and "finetune.data.max_caption_bytes" in out and "cache_content_digest" in out


def test_the_family_frame_rule_and_settings_that_do_not_apply(media):
    from tests.pipelines import tiny_pipeline_folder

    wan = [f"finetune.pipeline={tiny_pipeline_folder('wan')}", f"finetune.data.folder={media}",
           "global_batch_size=2"]  # fmt: skip
    code, out = inspect(VIDEO, *wan, "finetune.data.max_frames=8")
    assert (
        code == 2
        and "field 'finetune.data.max_frames': WanPipeline's VAE takes k * 4 + 1 frames, not 8; use 5 or 9."
        in out
    )
    assert inspect(VIDEO, *wan, "finetune.data.max_frames=1")[0] == 0  # images as one frame
    flux = [f"finetune.pipeline={tiny_pipeline_folder('flux')}", f"finetune.data.folder={media}",
            "global_batch_size=2"]  # fmt: skip
    assert inspect(IMAGE, *flux)[0] == 0
    code, out = inspect(IMAGE, *flux, "finetune.data.max_frames=9", "finetune.data.frame_stride=2")
    assert code == 2
    assert "field 'finetune.data.max_frames': 9 does not apply to FluxPipeline" in out
    assert "field 'finetune.data.frame_stride': 2 does not apply" in out


def test_batch_feasibility_from_the_scan_without_encoding(media, tmp_path):
    from litegen.finetune.media import media_problems
    from litegen.finetune.pipeline import pipeline_family
    from tests.pipelines import tiny_pipeline_folder

    cache = tmp_path / "cache"

    def problems(batch: int) -> tuple[list[str], list[str]]:
        overrides = [f"finetune.pipeline={tiny_pipeline_folder('wan')}", f"finetune.data.folder={media}",
                     f"finetune.data.cache_root={cache}", "finetune.data.max_frames=9",
                     "finetune.data.resolution=32", f"global_batch_size={batch}"]  # fmt: skip
        config = load_recipe(VIDEO, overrides).config
        return media_problems(config, pipeline_family(config))

    errors, notes = problems(4)  # the 4 clips fill a batch; the 2 images never do
    assert errors == [] and len(notes) == 1
    assert "holds 2 file(s), fewer than global_batch_size=4: never trained" in notes[0]
    assert all(str(media / "photos" / f"image_{i}.png") in notes[0] for i in range(2))
    errors, _ = problems(8)
    assert (
        len(errors) == 1
        and "field 'global_batch_size': 8 samples per step, but no bucket" in errors[0]
    )
    code, out = inspect(VIDEO, f"finetune.pipeline={tiny_pipeline_folder('wan')}",
                        f"finetune.data.folder={media}", "global_batch_size=8")  # fmt: skip
    assert code == 2 and "no bucket (frames, height, width)" in out
    assert not cache.exists()  # nothing encoded, no cache folder


def test_a_caption_in_invalid_utf8_is_a_bad_file(tmp_path):
    from tests.media import make_media_folder

    root = make_media_folder(tmp_path / "media", images=2, videos=0)
    bad = root / "photos" / "image_1.txt"
    bad.write_bytes(b"a caf\xe9 in latin-1")
    files, skipped = scan_media(root)
    assert [f.path.name for f in files] == ["image_0.png"]
    image = bad.with_suffix(".png")
    assert any(b.path == image and "image_1.txt is not valid UTF-8" in b.reason for b in skipped)
    with pytest.raises(ValueError, match=rf"{image}: its caption file image_1.txt is not valid"):
        scan_media(root, on_bad="error")


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_the_lr_schedule_warms_up_then_decays(name):
    from litegen.finetune.training import lr_schedule

    config = MainConfig.from_dict({"lr": 0.5, "max_steps": 6, "finetune": {
        "lr_schedule": {"name": name, "warmup_steps": 2}}})  # fmt: skip
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = lr_schedule(config, optimizer)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    decay = {
        "constant": lambda p: 1.0,
        "linear": lambda p: 1.0 - p,
        "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    }[name]
    expected = [0.25, 0.5] + [0.5 * decay((s - 2) / 4) for s in range(2, 6)]
    assert seen == pytest.approx(expected)
