"""The files of a media folder: which are images or videos, their captions, sizes and lengths.

:func:`scan_media` walks a folder (recursively), pairs each image or video with its caption and
reads its size (and frame count) without decoding it whole. Captions come from a
``metadata.jsonl`` or ``metadata.csv`` at the folder's root (a file column and a caption
column), else from a ``.txt`` file of the same name next to the media file. A file that cannot
be used (corrupt, empty, unreadable, no caption, a caption over ``max_caption_bytes``, a name
that is not valid UTF-8, or a caption file without media) is a :class:`BadFile` with its path
and the reason; ``on_bad="skip"`` leaves it out and logs the
count, ``on_bad="error"`` refuses the folder with every bad file listed.

Condition files (a first frame, a reference image, a control video) go with a media file
through a metadata column or a companion file ``<stem>.<name>.<ext>``
(:mod:`litegen.data.media_conditions`); ``conditions`` names the ones the model takes, by kind.
A missing or unreadable condition file, or a missing ``required`` one, makes its media file bad.

Pillow reads images; PyAV (``pip install 'litegen-core[media]'``) reads videos, imported only
when the folder has one.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal

from litegen.data.media_conditions import companion_files, metadata_conditions, untaken_problem

log = logging.getLogger("litegen")

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi"})
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
FILE_COLUMNS = ("file_name", "file", "path", "video", "image")
CAPTION_COLUMNS = ("caption", "text", "prompt")
# A caption is a prompt the text encoder reads a few hundred tokens of; a bound keeps a stray
# huge file from exhausting the host's memory in the tokenizer.
MAX_CAPTION_BYTES = 1 << 20

OnBad = Literal["skip", "error"]


@dataclasses.dataclass(frozen=True)
class MediaFile:
    """One usable image or video: its caption, size and (videos) frame count."""

    path: Path
    caption: str
    width: int
    height: int
    frames: int = 1  # 1 for an image
    is_video: bool = False
    conditions: tuple[tuple[str, Path], ...] = ()  # (condition name, its file), by name


@dataclasses.dataclass(frozen=True)
class BadFile:
    """A file of the folder that cannot be trained on, and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{printable(self.path)}: {self.reason}"


def printable(path: Path) -> str:
    """``path`` as text that prints anywhere: bytes of a name that is not valid UTF-8 show as
    ``\\xNN`` escapes.

    >>> printable(Path(os.fsdecode(b"caf\\xe9.png")))
    'caf\\\\xe9.png'
    """
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


def _utf8_name(path: Path) -> bool:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def scan_media(
    root: str | Path,
    *,
    recursive: bool = True,
    on_bad: OnBad = "skip",
    max_caption_bytes: int = MAX_CAPTION_BYTES,
    conditions: Mapping[str, Literal["image", "video"]] | None = None,
    required: Collection[str] = (),
) -> tuple[list[MediaFile], list[BadFile]]:
    """The usable media files under ``root`` (sorted by path) and the bad ones. A caption
    longer than ``max_caption_bytes`` (UTF-8) makes its file bad, unread. ``conditions``
    names the condition files the model takes and their kind; condition files of other names
    raise a ``ValueError`` whatever ``on_bad`` says (``None``: conditions are not looked at).

    Example::

        files, bad = scan_media("my_media/")
        files[0].caption, files[0].width, files[0].height, files[0].frames
    """
    if on_bad not in ("skip", "error"):
        raise ValueError(f"on_bad must be 'skip' or 'error', got {on_bad!r}.")
    root = Path(root)
    paths, media = _listing(root, recursive)
    companions: dict[Path, dict[str, Path]] = {}
    if conditions is not None:  # condition files are not samples
        media, companions, orphans = companion_files(media)
        bad_orphans = [
            BadFile(p, "condition file without a media file of the same name") for p in orphans
        ]
    # Names that are not UTF-8 cannot go into the cache keys or most logs: named, left out.
    bad = [
        BadFile(path, "its name is not valid UTF-8: rename it (e.g. convmv -f latin1 -t utf8)")
        for path in media
        if not _utf8_name(path)
    ]
    captions, bad_captions, columns = _captions(root, paths, media, max_caption_bytes)
    bad += bad_captions
    found: dict[Path, dict[str, Path]] = {}
    if conditions is not None:
        found = {
            p: {**companions.get(p, {}), **columns.get(p, {})} for p in {*companions, *columns}
        }
        bad += bad_orphans
        problem = untaken_problem(root, found, conditions)
        if problem:
            raise ValueError(problem)
    referenced = {file for given in found.values() for file in given.values()}
    files = []
    for path in filter(_utf8_name, media):
        if path in referenced:  # a metadata column's condition file, not a sample
            continue
        if path not in captions:
            bad.append(BadFile(path, "no caption: add a same-name .txt file or a metadata row"))
            continue
        if isinstance(captions[path], BadFile):
            bad.append(captions[path])
            continue
        probed = _probe(path, captions[path])
        if isinstance(probed, MediaFile) and conditions is not None:
            probed = _with_conditions(probed, found.get(path, {}), conditions, required)
        (files if isinstance(probed, MediaFile) else bad).append(probed)
    bad.sort(key=lambda b: b.path)
    if bad and on_bad == "error":
        listed = "\n  ".join(str(b) for b in bad)
        raise ValueError(
            f"{len(bad)} bad file(s) in media folder {root}:\n  {listed}\n"
            "fix or remove them, or set on_bad='skip' to leave them out."
        )
    if bad:
        log.warning(
            "media folder %s: skipped %d bad file(s):\n  %s",
            root,
            len(bad),
            "\n  ".join(str(b) for b in bad),
        )
    if not files:
        raise ValueError(f"media folder {root} has no usable file: every one is bad (see above).")
    log.info("media folder %s: %d file(s), %d skipped", root, len(files), len(bad))
    return files, bad


def media_paths(root: str | Path, *, recursive: bool = True) -> list[Path]:
    """The image and video files under ``root`` by name alone (nothing is opened), sorted; a
    ``ValueError`` naming the folder when it is missing or holds none. Cheap enough to check a
    folder before the ranks start.

    Example:
        >>> from PIL import Image
        >>> Path("my_media").mkdir()
        >>> Image.new("RGB", (64, 48)).save("my_media/fox.png")
        >>> media_paths("my_media/")
        [PosixPath('my_media/fox.png')]
    """
    return _listing(Path(root), recursive)[1]


def _listing(root: Path, recursive: bool) -> tuple[list[Path], list[Path]]:
    """Every file under ``root``, and the media files among them."""
    if not root.is_dir():
        raise ValueError(f"media folder {root} does not exist or is not a folder; check the path.")
    paths = sorted(p for p in (root.rglob("*") if recursive else root.iterdir()) if p.is_file())
    media = [p for p in paths if p.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES]
    if not media:
        raise ValueError(
            f"media folder {root} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))}) or "
            f"videos ({', '.join(sorted(VIDEO_SUFFIXES))}); put media files in it"
            f"{'' if recursive else ' or scan it recursively'}."
        )
    return paths, media


def _captions(
    root: Path, paths: list[Path], media: list[Path], max_bytes: int
) -> tuple[dict[Path, str | BadFile], list[BadFile], dict[Path, dict[str, Path]]]:
    """Captions by media path, from the metadata file if there is one, else from .txt files
    (a caption over ``max_bytes`` is the :class:`BadFile` of its media file instead), and the
    metadata's condition columns by media path."""
    metadata = [root / name for name in METADATA_FILES if (root / name).is_file()]
    if metadata:
        return _metadata_captions(metadata[0], set(media), max_bytes)
    media_stems = {p.with_suffix("") for p in media}
    captions, bad = {}, []
    for path in paths:
        if path.suffix.lower() != ".txt":
            continue
        if path.with_suffix("") not in media_stems:
            bad.append(BadFile(path, "caption file without a media file of the same name"))
    for path in media:
        text_file = path.with_suffix(".txt")
        if not text_file.is_file():
            continue
        size = text_file.stat().st_size
        if size > max_bytes:  # checked before reading: the file may be any size
            captions[path] = BadFile(
                path, _too_long(f"its caption file {text_file.name}", size, max_bytes)
            )
            continue
        try:
            text = text_file.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError as error:  # would train on replacement characters
            captions[path] = BadFile(
                path,
                f"its caption file {text_file.name} is not valid UTF-8 ({error.reason} at "
                f"byte {error.start}): save it as UTF-8",
            )
            continue
        if text:
            captions[path] = text
    return captions, bad, {}


def _too_long(what: str, size: int, limit: int) -> str:
    return (
        f"{what} has {size} bytes, over the caption limit of {limit} bytes: shorten it (a text "
        "encoder reads a few hundred tokens), or raise max_caption_bytes"
    )


def _metadata_captions(
    metadata: Path, media: set[Path], max_bytes: int
) -> tuple[dict[Path, str | BadFile], list[BadFile], dict[Path, dict[str, Path]]]:
    rows = _read_rows(metadata)
    columns = set().union(*(row.keys() for row in rows)) if rows else set()
    file_column = next((c for c in FILE_COLUMNS if c in columns), None)
    caption_column = next((c for c in CAPTION_COLUMNS if c in columns), None)
    if file_column is None or caption_column is None:
        raise ValueError(
            f"{metadata} needs a file column ({' / '.join(FILE_COLUMNS)}) and a caption column "
            f"({' / '.join(CAPTION_COLUMNS)}); it has {sorted(columns) or 'no rows'}."
        )
    captions, bad, named = {}, [], []
    for number, row in enumerate(rows, start=2 if metadata.suffix == ".csv" else 1):
        path = metadata.parent / str(row.get(file_column) or "")
        caption = str(row.get(caption_column) or "").strip()
        named.append((number, path, row))
        if path not in media:
            bad.append(BadFile(metadata, f"row {number} names {path.name!r}, not a media file"))
        elif len(caption.encode("utf-8", errors="surrogatepass")) > max_bytes:
            size = len(caption.encode("utf-8", errors="surrogatepass"))
            captions[path] = BadFile(
                path, _too_long(f"its caption ({metadata.name} row {number})", size, max_bytes)
            )
        elif caption:
            captions[path] = caption
    return captions, bad, metadata_conditions(metadata, named, file_column)


def _read_rows(metadata: Path) -> list[dict]:
    try:
        text = metadata.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{metadata} is not valid UTF-8 ({error.reason} at byte {error.start}); save it "
            "as UTF-8."
        ) from None
    if metadata.suffix == ".csv":
        return list(csv.DictReader(text.splitlines()))
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{metadata} line {number} is not JSON ({error}); fix the line."
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{metadata} line {number} is not a JSON object; write one per line.")
        rows.append(row)
    return rows


def _probe(path: Path, caption: str) -> MediaFile | BadFile:
    """Size and length without decoding the whole file, or why it cannot be read."""
    if path.stat().st_size == 0:
        return BadFile(path, "empty file")
    try:
        if path.suffix.lower() in IMAGE_SUFFIXES:
            width, height = _image_size(path)
            return MediaFile(path, caption, width, height)
        width, height, frames = _video_size(path)
    except Exception as error:  # any decoder failure is this file's fault, reported per file
        return BadFile(path, f"unreadable ({type(error).__name__}: {error})")
    if frames < 1:
        return BadFile(path, "no video frames")
    return MediaFile(path, caption, width, height, frames, is_video=True)


def _with_conditions(
    file: MediaFile,
    given: dict[str, Path],
    kinds: Mapping[str, Literal["image", "video"]],
    required: Collection[str],
) -> MediaFile | BadFile:
    """``file`` with its condition files, each checked to be a readable file of its kind, or
    the :class:`BadFile` saying which one is missing or unreadable."""
    for name in sorted(required):
        if name not in given:
            stem = file.path.with_suffix("").name
            return BadFile(
                file.path,
                f"no {name} condition: add a companion file {stem}.{name}.<ext> or a "
                f"{name!r} metadata column",
            )
    for name, path in sorted(given.items()):
        kind = kinds[name]
        suffixes = IMAGE_SUFFIXES if kind == "image" else VIDEO_SUFFIXES
        if not path.is_file():
            return BadFile(file.path, f"its {name} condition {path} does not exist")
        if path.suffix.lower() not in suffixes:
            what = "an image" if kind == "image" else "a video"
            return BadFile(file.path, f"its {name} condition {path} is not {what} file")
        try:
            _image_size(path) if kind == "image" else _video_size(path)
        except Exception as error:  # the condition's fault, named with its media file
            return BadFile(
                file.path,
                f"its {name} condition {path} is unreadable ({type(error).__name__}: {error})",
            )
    return dataclasses.replace(file, conditions=tuple(sorted(given.items())))


def _image_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        image.verify()  # reads the whole file: truncated or corrupt data fails here
        return image.size


def _video_size(path: Path) -> tuple[int, int, int]:
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        decoded = container.decode(stream)
        first = next(decoded, None)  # a corrupt stream fails here, not in a training worker
        if first is None:
            raise ValueError("no decodable frame")
        # Containers that store no frame count are counted by decoding them.
        frames = stream.frames or 1 + sum(1 for _ in decoded)
        return first.width, first.height, frames
