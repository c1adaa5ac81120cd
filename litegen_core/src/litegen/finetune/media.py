"""The media folder of a fine-tuning run: its dataset, and what can be known of it before any
rank starts (the family's frame rule, settings that do not apply, which buckets can fill a
global batch), from a scan that reads sizes and lengths and encodes nothing, without torch.

Example::

    dataset = media_dataset(config, family)
    problems, notes = media_problems(config, family)   # errors, and warnings to show
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litegen.data.media_buckets import MediaBuckets
from litegen.data.media_files import media_paths, scan_media
from litegen.families import Family
from litegen.finetune.pipeline import pipeline_folder, read_json, settings

if TYPE_CHECKING:
    from litegen.data import MediaDataset
    from litegen.data.media_files import MediaFile


def media_folder(config: Any) -> str:
    folder = settings(config).data.folder
    if not folder:
        raise ValueError(
            "finetune.data.folder is not set: give the folder of images and videos with "
            "captions (docs/finetune.md#media-folders)."
        )
    return folder


def bucket_rule(config: Any, family: Family) -> MediaBuckets:
    """The family's bucket rule at ``finetune.data``'s settings."""
    vae = read_json(pipeline_folder(config) / "vae" / "config.json")
    return family.buckets(vae, settings(config).data)


def scan_options(config: Any, family: Family) -> dict[str, Any]:
    """What the media scan needs from the settings and the family: the bad-file policy, the
    caption bound, and the condition files the family takes (their kinds) and requires."""
    data = settings(config).data
    taken = family.media_conditions
    return {
        "on_bad": data.on_bad,
        "max_caption_bytes": data.max_caption_bytes,
        "conditions": {name: condition.kind for name, condition in taken.items()},
        "required": [name for name, condition in taken.items() if condition.required],
    }


def media_dataset(config: Any, family: Family) -> MediaDataset:
    """The bucketed ``(pixels, caption)`` samples of ``finetune.data.folder``, with the
    condition files of the family's media conditions (``dataset.conditions(i)``)."""
    from litegen.data import MediaDataset

    options = scan_options(config, family)
    dataset = MediaDataset(media_folder(config), buckets=bucket_rule(config, family), **options)
    problem = optional_conditions_problem(media_folder(config), dataset.files, family)
    if problem:
        raise ValueError(problem)
    return dataset


def optional_conditions_problem(root: str, files: list[MediaFile], family: Family) -> str | None:
    """Batches stack every sample's tensors, so an optional condition without a default is
    given for every file or for none: the message naming the files that lack it, or None."""
    for name, condition in sorted(family.media_conditions.items()):
        if condition.required or condition.default is not None:
            continue
        lacking = [str(file.path) for file in files if name not in dict(file.conditions)]
        if lacking and len(lacking) < len(files):
            shown = ", ".join(lacking[:5]) + (", ..." if len(lacking) > 5 else "")
            return (
                f"the {name} condition is given for {len(files) - len(lacking)} of "
                f"{len(files)} files of media folder {root}: give it for every "
                f"file or for none; {len(lacking)} lack it: {shown}"
            )
    return None


def settings_problems(config: Any, family: Family) -> list[str]:
    """The ``finetune.data`` settings this family cannot use: an image family's frame
    settings (it trains one frame per sample), a frame count off the VAE's rule."""
    data = settings(config).data
    problems = []
    if not family.latent.is_video:
        for name in ("max_frames", "frame_stride"):
            if getattr(data, name) != 1:
                problems.append(
                    f"field 'finetune.data.{name}': {getattr(data, name)} does not apply to "
                    f"{family.pipeline_class}, an image family that trains one frame per "
                    f"sample; remove it (or set it to 1)."
                )
        return problems
    vae = read_json(pipeline_folder(config) / "vae" / "config.json")
    step = family.temporal_compression(vae)
    if (data.max_frames - 1) % step:
        below = (data.max_frames - 1) // step * step + 1
        problems.append(
            f"field 'finetune.data.max_frames': {family.pipeline_class}'s VAE takes k * {step} "
            f"+ 1 frames, not {data.max_frames}; use {below} or {below + step}."
        )
    return problems


def batch_problems(config: Any, family: Family) -> tuple[list[str], list[str]]:
    """``(errors, warnings)`` of the scanned folder at the global batch size: each global
    batch comes from one bucket, so a bucket smaller than the global batch is never drawn
    (a warning naming its files), and none able to fill one is an error."""
    rule = bucket_rule(config, family)
    files, _ = scan_media(media_folder(config), **scan_options(config, family))
    problem = optional_conditions_problem(media_folder(config), files, family)
    if problem:
        return [problem], []
    buckets: dict[tuple[int, int, int], list[str]] = {}
    for file in files:
        buckets.setdefault(rule.bucket(file), []).append(str(file.path))
    batch = config.global_batch_size
    small = {key: paths for key, paths in buckets.items() if len(paths) < batch}
    sizes = ", ".join(f"{k}: {len(v)}" for k, v in sorted(buckets.items()))
    if len(small) == len(buckets):
        return [
            f"field 'global_batch_size': {batch} samples per step, but no bucket (frames, "
            f"height, width) of media folder {media_folder(config)} holds that many ({sizes}); "
            "lower global_batch_size, add files, or lower finetune.data.resolution so that more "
            "files share a bucket."
        ], []
    notes = [
        f"bucket {key} holds {len(paths)} file(s), fewer than global_batch_size={batch}: "
        f"never trained: {', '.join(paths)}"
        for key, paths in sorted(small.items())
    ]
    return [], notes


def media_problems(config: Any, family: Family) -> tuple[list[str], list[str]]:
    """Every problem of the media settings and folder found without encoding: ``(errors,
    warnings)``. Bad files are errors under ``on_bad: error``."""
    problems = settings_problems(config, family)
    try:
        media_paths(media_folder(config))
    except ValueError as err:
        return [*problems, str(err)], []
    if problems:
        return problems, []
    try:
        return batch_problems(config, family)
    except ValueError as err:
        return [str(err)], []


__all__ = [
    "batch_problems",
    "bucket_rule",
    "media_dataset",
    "media_folder",
    "media_problems",
    "optional_conditions_problem",
    "scan_options",
    "settings_problems",
]
