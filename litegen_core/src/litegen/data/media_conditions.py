"""The condition files of a media folder: a first frame, a reference image or a control video
that goes with a clip, found beside its caption.

A condition is named (:data:`CONDITION_NAMES`) and given per media file in one of two ways:

- a column of the root's ``metadata.jsonl``/``metadata.csv`` under the condition's name, whose
  value is a file path relative to the folder (``{"file_name": "a.mp4", "caption": "...",
  "image": "first/a.png"}``);
- a companion file ``<stem>.<name>.<ext>`` next to the media file (``a.mp4`` and
  ``a.image.png``; ``a.control_video.mp4``).

A metadata value wins over a companion file. Condition files are never trained on as media
themselves. Which names a model takes, and which it requires, comes from its family; a
condition file it does not take is refused with the names it does, not silently ignored.

Example::

    conditions, orphans = companion_files(media_paths)   # {a.mp4: {"image": a.image.png}}
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

# The condition names the media folder knows: a metadata column or companion suffix of one
# of these is a condition, any other column is left alone.
CONDITION_NAMES = ("image", "last_image", "reference", "control_image", "control_video")


def condition_of(path: Path) -> str | None:
    """The condition a companion file gives (``a.image.png`` -> ``image``), or None.

    >>> condition_of(Path("clips/a.image.png")), condition_of(Path("clips/a.png"))
    ('image', None)
    """
    name = Path(path.stem).suffix[1:]
    return name if name in CONDITION_NAMES else None


def companion_files(
    media: Iterable[Path],
) -> tuple[list[Path], dict[Path, dict[str, Path]], list[Path]]:
    """Split the media files into ``(trained, conditions, orphans)``: the files trained on,
    each one's companion condition files by name, and the companions with no media file of
    their stem."""
    media = list(media)
    companions = [p for p in media if condition_of(p)]
    trained = [p for p in media if not condition_of(p)]
    by_stem = {p.with_suffix(""): p for p in trained}
    conditions: dict[Path, dict[str, Path]] = {}
    orphans = []
    for path in companions:
        owner = by_stem.get(path.parent / Path(path.stem).stem)
        if owner is None:
            orphans.append(path)
        else:
            conditions.setdefault(owner, {})[condition_of(path)] = path
    return trained, conditions, orphans


def metadata_conditions(
    metadata: Path, rows: list[tuple[int, Path, dict]], file_column: str
) -> dict[Path, dict[str, Path]]:
    """The condition columns of the metadata rows ``(row number, media path, row)``: per
    media path, each condition's file (relative to the metadata's folder)."""
    out: dict[Path, dict[str, Path]] = {}
    for _, path, row in rows:
        for name in CONDITION_NAMES:
            value = row.get(name)
            if name != file_column and value not in (None, ""):
                out.setdefault(path, {})[name] = metadata.parent / str(value)
    return out


def untaken_problem(
    root: Path, found: dict[Path, dict[str, Path]], taken: Iterable[str]
) -> str | None:
    """The message for condition files the model does not take, naming one of each, or None."""
    taken = sorted(taken)
    extra: dict[str, Path] = {}
    for _, conditions in sorted(found.items()):
        for name, file in conditions.items():
            if name not in taken:
                extra.setdefault(name, file)
    if not extra:
        return None
    listed = ", ".join(f"{name} (e.g. {file})" for name, file in sorted(extra.items()))
    takes = f"takes only {', '.join(taken)}" if taken else "takes no condition files"
    return (
        f"media folder {root} gives the condition(s) {listed}, but the model {takes}: remove "
        "those files or metadata columns, or train a pipeline that takes them "
        "(docs/finetune.md#conditions)."
    )


__all__ = [
    "CONDITION_NAMES",
    "companion_files",
    "condition_of",
    "metadata_conditions",
    "untaken_problem",
]
