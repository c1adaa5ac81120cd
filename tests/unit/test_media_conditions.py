"""Media conditions: condition files found in a media folder (companion files and metadata
columns), bad ones named, names the model does not take refused, their cache keys, the
first-frame default, and the validation conditions checked before the ranks start."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from litegen.cache import file_key
from litegen.data import MediaBuckets, MediaDataset, scan_media
from litegen.families import Family, MediaCondition
from litegen.finetune.cache import cache_keys, condition_pixels
from litegen.finetune.checks import validation_problems
from litegen.finetune.media import optional_conditions_problem
from tests.media import write_mp4, write_png

pytest.importorskip("av")
pytest.importorskip("PIL")

IMAGE = {"image": "image"}
VIDEO = MediaBuckets(resolution=32, spatial_multiple=16, max_frames=5, temporal_compression=4)


class FirstFrame(Family):
    name, pipeline_class = "first_frame_test", ""  # no pipeline class: not registered
    media_conditions: ClassVar[dict[str, MediaCondition]] = {
        "image": MediaCondition("image", "the first frame", default="first_frame")
    }


class OptionalControl(Family):
    name, pipeline_class = "optional_control_test", ""
    media_conditions: ClassVar[dict[str, MediaCondition]] = {
        "control_video": MediaCondition("video", "a control video", optional=True)
    }


def clip(root: Path, name: str, caption: str = "a clip") -> Path:
    path = write_mp4(root / f"{name}.mp4", 32, 32, frames=5)
    path.with_suffix(".txt").write_text(caption)
    return path


@pytest.fixture
def companions(tmp_path: Path) -> Path:
    """a.mp4 with a.image.png, b.mp4 without, and c.image.png without a clip."""
    clip(tmp_path, "a")
    clip(tmp_path, "b")
    write_png(tmp_path / "a.image.png", 64, 32, color=(255, 0, 0))
    write_png(tmp_path / "c.image.png", 32, 32)
    return tmp_path


def test_companion_files_go_with_their_clip_and_are_not_samples(companions: Path) -> None:
    files, bad = scan_media(companions, conditions=IMAGE)
    by_name = {f.path.name: f for f in files}
    assert sorted(by_name) == ["a.mp4", "b.mp4"]
    assert by_name["a.mp4"].conditions == (("image", companions / "a.image.png"),)
    assert by_name["b.mp4"].conditions == ()
    assert [(b.path.name, b.reason) for b in bad] == [
        ("c.image.png", "condition file without a media file of the same name")
    ]
    # Read at the clip's bucket: a 64x32 red image cropped to the 32x32 of its clip.
    dataset = MediaDataset(companions, buckets=VIDEO, conditions=IMAGE)
    image = dataset.conditions(0)["image"]
    assert image.shape == (3, 32, 32) and dataset[0][0].shape == (3, 5, 32, 32)
    assert torch.allclose(image[0], torch.ones(32, 32)) and image[1:].max() < -0.9
    assert dataset.conditions(1) == {}


def test_a_required_condition_missing_makes_its_file_bad(companions: Path) -> None:
    files, bad = scan_media(companions, conditions=IMAGE, required=["image"])
    assert [f.path.name for f in files] == ["a.mp4"]
    assert "b.mp4: no image condition: add a companion file b.image.<ext> or a 'image' " in (
        "\n".join(map(str, bad))
    )
    with pytest.raises(ValueError, match=r"b\.mp4: no image condition"):
        scan_media(companions, conditions=IMAGE, required=["image"], on_bad="error")


def test_a_condition_the_model_does_not_take_is_refused_naming_a_file(companions: Path) -> None:
    with pytest.raises(ValueError, match=r"gives the condition\(s\) image \(e\.g\. .*a\.image\.png"
                       r"\), but the model takes no condition files"):  # fmt: skip
        scan_media(companions, conditions={})
    with pytest.raises(ValueError, match=r"but the model takes only reference"):
        scan_media(companions, conditions={"reference": "image"})


def test_metadata_columns_name_condition_files_and_bad_ones_are_named(tmp_path: Path) -> None:
    clip(tmp_path / "clips", "a")
    clip(tmp_path / "clips", "b")
    clip(tmp_path / "clips", "c")
    write_png(tmp_path / "first" / "a.png", 32, 32)  # a media file, but only a condition here
    (tmp_path / "first" / "broken.png").write_bytes(b"not a png")
    rows = [
        {"video": "clips/a.mp4", "caption": "a", "image": "first/a.png", "fps": 8},
        {"video": "clips/b.mp4", "caption": "b", "image": "first/missing.png"},
        {"video": "clips/c.mp4", "caption": "c", "image": "first/broken.png"},
    ]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    files, bad = scan_media(tmp_path, conditions=IMAGE)
    assert [(f.path.name, f.conditions) for f in files] == [
        ("a.mp4", (("image", tmp_path / "first" / "a.png"),))
    ]
    reasons = {b.path.name: b.reason for b in bad}
    assert (
        reasons["b.mp4"] == f"its image condition {tmp_path / 'first/missing.png'} does not exist"
    )
    assert reasons["c.mp4"].startswith(f"its image condition {tmp_path / 'first/broken.png'} is "
                                       "unreadable")  # fmt: skip
    assert set(reasons) == {"b.mp4", "c.mp4"}  # the condition files are not samples
    with pytest.raises(ValueError, match=r"takes no condition files"):
        scan_media(tmp_path, conditions={})


def test_an_optional_condition_is_given_for_every_file_or_none(tmp_path: Path) -> None:
    clip(tmp_path, "a")
    clip(tmp_path, "b")
    write_mp4(tmp_path / "a.control_video.mp4", 32, 32, frames=5)
    files, _ = scan_media(tmp_path, conditions={"control_video": "video"})
    problem = optional_conditions_problem(str(tmp_path), files, OptionalControl())
    assert problem is not None and problem.startswith(
        f"the control_video condition is given for 1 of 2 files of media folder {tmp_path}: "
        f"give it for every file or for none; 1 lack it: {tmp_path / 'b.mp4'}"
    )
    write_mp4(tmp_path / "b.control_video.mp4", 32, 32, frames=5)
    files, _ = scan_media(tmp_path, conditions={"control_video": "video"})
    assert optional_conditions_problem(str(tmp_path), files, OptionalControl()) is None
    video = MediaDataset(tmp_path, buckets=VIDEO, conditions={"control_video": "video"})
    assert video.conditions(1)["control_video"].shape == (3, 5, 32, 32)


def test_cache_keys_cover_the_condition_files_and_keep_the_old_keys(companions: Path) -> None:
    dataset = MediaDataset(companions, buckets=VIDEO, conditions=IMAGE)
    a, b = dataset.files
    keys = cache_keys(dataset)
    # A file without conditions keeps the key of earlier versions.
    stat = b.path.stat()
    old = f"b.mp4|{stat.st_size}|{stat.st_mtime_ns}|{b.caption}"
    assert keys[1] == hashlib.sha256(old.encode()).hexdigest()[:24]
    assert keys[0] != file_key(a.path, root=companions, extra=a.caption)
    # Touching the condition file changes its clip's key; a digest of the bytes does not.
    digests = cache_keys(dataset, content_digest=True)
    image = companions / "a.image.png"
    os.utime(image, ns=(1, 1))
    assert cache_keys(dataset)[0] != keys[0] and cache_keys(dataset)[1] == keys[1]
    assert cache_keys(dataset, content_digest=True) == digests
    write_png(image, 64, 32, color=(0, 255, 0))
    assert cache_keys(dataset, content_digest=True)[0] != digests[0]


def test_the_first_frame_default_takes_frame_0_of_each_clip() -> None:
    clips = torch.randn(2, 3, 5, 8, 8)
    taken = condition_pixels(FirstFrame(), clips, [{}, {}])
    assert torch.equal(taken["image"], clips[:, :, 0])
    given = torch.randn(2, 3, 8, 8)
    taken = condition_pixels(FirstFrame(), clips, [{"image": given[0]}, {"image": given[1]}])
    assert torch.equal(taken["image"], given)
    assert condition_pixels(OptionalControl(), clips, [{}, {}]) == {}


def validation_config(prompts: list[str], conditions: dict, sample_every: int = 2):
    validation = SimpleNamespace(prompts=prompts, conditions=conditions)
    return SimpleNamespace(
        trainer=SimpleNamespace(validation=validation, sample_every=sample_every)
    )


def test_validation_conditions_are_checked_against_the_family(tmp_path: Path) -> None:
    first = write_png(tmp_path / "first.png", 32, 32)
    family = FirstFrame()
    good = validation_config(["a", "b"], {"image": [str(first), str(first)]})
    assert validation_problems(good, family) == []
    assert validation_problems(validation_config(["a"], {}, sample_every=0), family) == []
    problems = validation_problems(
        validation_config(["a", "b"], {"image": [str(tmp_path / "x.png")], "reference": []}),
        family,
    )
    assert problems == [
        "field 'trainer.validation.conditions.image': 1 file(s) for 2 prompt(s); give one file "
        "per prompt, in order.",
        f"field 'trainer.validation.conditions.image': {tmp_path / 'x.png'} does not exist.",
        "field 'trainer.validation.conditions.reference':  does not take a reference condition "
        "(it takes: image); remove it.",
    ]
    (missing,) = validation_problems(validation_config(["a"], {}), family)
    assert missing.startswith("field 'trainer.validation.conditions.image':  samples with its "
                              "image condition (the first frame); give one file per prompt")  # fmt: skip
