"""MediaDataset: captions from .txt or metadata, buckets from the files, bad files named."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from litegen.data import BucketBatchSampler, MediaBuckets, MediaDataset, pair_collate, scan_media
from litegen.data.media_files import MediaFile
from tests.media import make_media_folder, write_mp4, write_png

pytest.importorskip("av")
pytest.importorskip("PIL")

VIDEO = MediaBuckets(resolution=48, spatial_multiple=16, max_frames=9, temporal_compression=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_media_folder(tmp_path_factory.mktemp("media"), images=2, videos=2, frames=7)
    write_png(root / "photos" / "tall" / "portrait.png", 20, 40)  # recursive, another aspect
    (root / "photos" / "tall" / "portrait.txt").write_text("a tall photo\n")
    return root


def test_scan_reads_captions_sizes_and_lengths_recursively(folder: Path) -> None:
    files, bad = scan_media(folder)
    assert bad == []
    by_name = {f.path.name: f for f in files}
    assert sorted(by_name) == [
        "clip_0.mp4",
        "clip_1.mp4",
        "image_0.png",
        "image_1.png",
        "portrait.png",
    ]
    clip = by_name["clip_1.mp4"]
    assert (clip.caption, clip.width, clip.height, clip.frames, clip.is_video) == (
        "a clip number 1",
        48,
        32,
        7,
        True,
    )
    assert by_name["portrait.png"].caption == "a tall photo"
    assert (by_name["portrait.png"].width, by_name["portrait.png"].frames) == (20, 1)
    flat, _ = scan_media(folder / "photos", recursive=False)
    assert [f.path.name for f in flat] == ["image_0.png", "image_1.png"]
    with pytest.raises(ValueError, match="or scan it recursively"):
        scan_media(folder, recursive=False)


def test_buckets_follow_aspect_ratio_and_the_temporal_rule(folder: Path) -> None:
    dataset = MediaDataset(folder, buckets=VIDEO)
    keys = dict(zip((f.path.name for f in dataset.files), dataset.keys, strict=True))
    # 7 frames hold 5 = 4k+1. 48x32 is 3:2: about 48² pixels, sides rounded to 16, gives
    # 64x32 (width 48 sqrt(1.5) = 58.8, height 48 / sqrt(1.5) = 39.2); 20x40 is 1:2.
    assert keys["clip_0.mp4"] == (5, 32, 64)
    assert keys["image_0.png"] == (1, 32, 64)
    assert keys["portrait.png"] == (1, 64, 32)
    for frames, height, width in dataset.keys:
        assert (frames - 1) % 4 == 0 and height % 16 == 0 and width % 16 == 0


def test_frame_count_is_the_longest_k_times_compression_plus_one() -> None:
    rule = MediaBuckets(max_frames=17, temporal_compression=4)
    assert [rule.frame_count(n) for n in (1, 4, 5, 8, 9, 16, 17, 100)] == [
        1,
        1,
        5,
        5,
        9,
        13,
        17,
        17,
    ]
    ltx = MediaBuckets(max_frames=25, temporal_compression=8, frame_stride=2)
    assert ltx.frame_count(40) == 17  # 20 frames at stride 2 -> 8k+1 = 17
    with pytest.raises(ValueError, match=r"e\.g\. 13"):
        MediaBuckets(max_frames=16, temporal_compression=4)


def test_video_samples_are_the_bucket_shape_with_the_right_frames(folder: Path) -> None:
    dataset = MediaDataset(folder, buckets=VIDEO)
    index = next(i for i, f in enumerate(dataset.files) if f.path.name == "clip_0.mp4")
    pixels, caption = dataset[index]
    frames, height, width = dataset.keys[index]
    assert pixels.shape == (3, frames, height, width) and caption == "a clip number 0"
    # Frame i of the clip is grey level 16 i: the first `frames` frames, in order.
    levels = ((pixels.mean(dim=(0, 2, 3)) + 1) / 2 * 255).tolist()
    assert levels == pytest.approx([16 * i for i in range(frames)], abs=4)
    strided = MediaDataset(
        folder,
        buckets=MediaBuckets(resolution=32, max_frames=9, temporal_compression=2, frame_stride=2),
    )
    pixels, _ = strided[index]
    levels = ((pixels.mean(dim=(0, 2, 3)) + 1) / 2 * 255).tolist()
    assert levels == pytest.approx([0, 32, 64], abs=4)  # frames 0, 2, 4 of 7 at stride 2


def test_image_model_samples_and_video_first_frames(folder: Path) -> None:
    dataset = MediaDataset(folder, buckets=MediaBuckets(resolution=32))
    for index in range(len(dataset)):
        pixels, _ = dataset[index]
        assert pixels.shape == (3, *dataset.keys[index][1:])
        assert pixels.min() >= -1 and pixels.max() <= 1


def test_cover_crop_keeps_the_middle(tmp_path: Path) -> None:
    from PIL import Image

    array = torch.zeros(32, 96, 3, dtype=torch.uint8)
    array[:, 32:64, 1] = 255  # green middle third, black sides
    Image.fromarray(array.numpy()).save(tmp_path / "wide.png")
    (tmp_path / "wide.txt").write_text("green in the middle")
    dataset = MediaDataset(tmp_path, buckets=MediaBuckets(resolution=32, aspect_ratios=(1.0,)))
    pixels, _ = dataset[0]
    assert pixels.shape == (3, 32, 32)
    assert pixels[1].mean() > 0.9 and pixels[0].mean() < -0.9  # all green: the sides are cut


def test_metadata_jsonl_and_csv_give_the_captions(tmp_path: Path) -> None:
    write_png(tmp_path / "a.png", 32, 32)
    write_mp4(tmp_path / "sub" / "b.mp4", 32, 32, 5)
    rows = [{"file_name": "a.png", "text": "first"}, {"file_name": "sub/b.mp4", "text": "second"}]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    files, bad = scan_media(tmp_path)
    assert [(f.path.name, f.caption) for f in files] == [("a.png", "first"), ("b.mp4", "second")]
    assert bad == []
    rows.append({"file_name": "gone.png", "text": "deleted"})
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    _, bad = scan_media(tmp_path)
    assert [str(b) for b in bad] == [
        f"{tmp_path / 'metadata.jsonl'}: row 3 names 'gone.png', not a media file"
    ]
    (tmp_path / "metadata.jsonl").unlink()
    (tmp_path / "metadata.csv").write_text("file,caption\na.png,one\nsub/b.mp4,two\n")
    files, _ = scan_media(tmp_path)
    assert [f.caption for f in files] == ["one", "two"]
    (tmp_path / "metadata.csv").write_text("name,caption\na.png,one\n")
    with pytest.raises(ValueError, match="file column"):
        scan_media(tmp_path)


@pytest.fixture
def bad_folder(tmp_path: Path) -> Path:
    write_png(tmp_path / "good.png", 32, 32)
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    (tmp_path / "corrupt.txt").write_text("broken image")
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "empty.txt").write_text("no bytes")
    (tmp_path / "noise.mp4").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "noise.txt").write_text("not a video")
    write_png(tmp_path / "uncaptioned.png", 32, 32)
    (tmp_path / "orphan.txt").write_text("a caption without media")
    return tmp_path


def test_bad_files_are_skipped_with_path_and_reason(bad_folder: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="litegen"):
        dataset = MediaDataset(bad_folder, on_bad="skip")
    assert [f.path.name for f in dataset.files] == ["good.png"]
    reasons = {b.path.name: b.reason for b in dataset.bad}
    assert sorted(reasons) == [
        "corrupt.png",
        "empty.mp4",
        "noise.mp4",
        "orphan.txt",
        "uncaptioned.png",
    ]
    assert reasons["empty.mp4"] == "empty file"
    assert reasons["corrupt.png"].startswith("unreadable")
    assert reasons["noise.mp4"].startswith("unreadable")
    assert "no caption" in reasons["uncaptioned.png"]
    assert "without a media file" in reasons["orphan.txt"]
    assert "skipped 5 bad file(s)" in caplog.text and str(bad_folder / "noise.mp4") in caplog.text
    assert "1 file(s), 5 skipped" in caplog.text


def test_bad_files_refuse_the_folder_when_asked(bad_folder: Path) -> None:
    with pytest.raises(ValueError, match="5 bad file") as error:
        MediaDataset(bad_folder, on_bad="error")
    for name in ("corrupt.png", "empty.mp4", "noise.mp4", "orphan.txt", "uncaptioned.png"):
        assert str(bad_folder / name) in str(error.value)


def test_empty_folder_and_missing_folder_are_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no media here")
    with pytest.raises(ValueError, match="holds no images"):
        MediaDataset(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        MediaDataset(tmp_path / "missing")


def test_a_file_broken_after_the_scan_is_named(tmp_path: Path) -> None:
    write_mp4(tmp_path / "clip.mp4", 32, 32, 5)
    (tmp_path / "clip.txt").write_text("a clip")
    dataset = MediaDataset(tmp_path, buckets=MediaBuckets(resolution=32, max_frames=5))
    (tmp_path / "clip.mp4").write_bytes(b"overwritten")
    with pytest.raises(ValueError, match=r"could not decode .*clip\.mp4"):
        dataset[0]


def test_bucket_batches_stack_without_padding(folder: Path) -> None:
    dataset = MediaDataset(folder, buckets=VIDEO)
    sampler = BucketBatchSampler(dataset.keys, global_batch_size=2, max_steps=4, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pair_collate)
    for pixels, captions in loader:
        assert pixels.dim() == 5 and len(captions) == 2


def test_docstring_bucket_example() -> None:
    rule = MediaBuckets(resolution=64, spatial_multiple=16, max_frames=17)
    clip = MediaFile(Path("a.mp4"), "a fox", 640, 360, frames=30, is_video=True)
    assert rule.bucket(clip) == (17, 48, 80)


def test_a_caption_over_the_limit_is_named_and_never_read(tmp_path: Path) -> None:
    write_png(tmp_path / "good.png", 32, 32)
    (tmp_path / "good.txt").write_text("fine")
    write_png(tmp_path / "huge.png", 32, 32)
    (tmp_path / "huge.txt").write_bytes(b"a fox " * 200_000)  # 1.2 MB, past the 1 MiB default
    files, bad = scan_media(tmp_path)
    assert [f.path.name for f in files] == ["good.png"]
    [(path, reason)] = [(b.path, b.reason) for b in bad]
    assert path == tmp_path / "huge.png"
    assert reason.startswith("its caption file huge.txt has 1200000 bytes, over the caption limit")
    rows = [{"file_name": "good.png", "text": "x" * 65}, {"file_name": "huge.png", "text": "ok"}]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(
        ValueError, match=r"good\.png: its caption \(metadata\.jsonl row 1\) has 65"
    ):
        MediaDataset(tmp_path, on_bad="error", max_caption_bytes=64)


def test_a_name_that_is_not_utf8_is_a_bad_file_named_printably(tmp_path: Path) -> None:
    write_png(tmp_path / "good.png", 32, 32)
    (tmp_path / "good.txt").write_text("fine")
    latin1 = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9.png")))
    write_png(latin1, 32, 32)
    latin1.with_suffix(".txt").write_text("a cafe")
    files, bad = scan_media(tmp_path)
    assert [f.path.name for f in files] == ["good.png"]
    assert [str(b) for b in bad] == [
        f"{tmp_path}/caf\\xe9.png: its name is not valid UTF-8: rename it "
        "(e.g. convmv -f latin1 -t utf8)"
    ]
