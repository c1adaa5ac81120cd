"""Entry module of recipes/finetune_image.yaml and recipes/finetune_video.yaml: fine-tune the
transformer of a diffusers pipeline folder on a folder of media with captions.

    uv run litegen cache build recipes/finetune_video.yaml model.pretrained=DIR data.folder=MEDIA
    uv run litegen launch recipes/finetune_video.yaml model.pretrained=DIR data.folder=MEDIA

``model.pretrained`` is a pipeline folder (``model_index.json`` and one subfolder per
component); its pipeline class picks the family (``finetune_families.py``: Wan, Flux).
``data.folder`` is read by :class:`litegen.data.MediaDataset` (captions from ``.txt`` files or a
``metadata.jsonl``/``.csv``; buckets from each file's aspect ratio and length).

Latents (the pipeline's VAE) and text embeddings (its text encoders) are computed once into a
:class:`litegen.cache.TensorCache` under ``data.cache_root``: by ``litegen cache build`` ahead of
training, or at the start of the launch for whatever is missing, each rank encoding its share.
The namespace is a fingerprint of the pipeline's files (transformer aside), the bucket rule and
the family; each entry's key is the file's path, size, modification time and caption, so added
or edited files are encoded and the rest is read back. Training reads the cache alone: the VAE
and text encoders are loaded again only to sample (``trainer.validation.prompts``, every
``trainer.sample_every`` steps, written as a PNG or MP4 grid under ``samples/step_<N>/``).

The loss is flow matching (:class:`litegen.objectives.FlowMatching`) with the pipeline
scheduler's shift and ``objective.density`` / ``objective.weighting``. At the end, ``finish``
writes ``<results_dir>/pipeline``, the pipeline folder with the trained transformer (full
fine-tuning), or ``<results_dir>/lora``: the LoRA adapters as ``<exp_name>.ema.lora.safetensors``
(``load_lora_weights``) and the peft folder ``<exp_name>.ema.peft`` (``.ema`` when
``trainer.export_ema``). ``litegen export --from <checkpoint_dir>/step_<N>`` writes the same from
a run checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from finetune_families import Family, family_of
from torch.utils.data import DataLoader, Dataset, default_collate

from litegen.cache import TensorCache, fill_cache, fingerprint
from litegen.data import BucketBatchSampler, MediaDataset
from litegen.data.media_files import media_paths
from litegen.export import export_name, write_export
from litegen.objectives import FlowMatching
from litegen.pretrained import check_pipeline_folder, load_component, load_pipeline

CACHE_VERSION = 1  # bump when encode() changes what it stores

_sampling_pipe: Any = None  # loaded at the first sample() and kept for the next ones


# -- the pipeline folder -------------------------------------------------------------------------
def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def pipeline_folder(config) -> Path:
    folder = config.model.get("pretrained")
    if not folder:
        raise ValueError(
            "model.pretrained is not set: give the diffusers pipeline folder to fine-tune "
            "(python -m litegen_zoo.make_tiny_pipeline writes a tiny one)."
        )
    check_pipeline_folder(folder)
    return Path(folder)


def pipeline_family(config) -> Family:
    folder = pipeline_folder(config)
    scheduler = _json(folder / "scheduler" / "scheduler_config.json")
    return family_of(_json(folder / "model_index.json"), str(folder), scheduler)


def check_inputs(config) -> None:
    """The bad input found from the config alone, before the ranks start
    (:func:`litegen.entry.check_inputs`): the pipeline folder, a missing component, a pipeline
    class without a family (none to sample with), and a media folder with no media."""
    pipeline_family(config)
    if not config.data.get("folder"):
        raise ValueError(
            "data.folder is not set: give the folder of images and videos with captions "
            "(docs/finetune.md#media-folders)."
        )
    media_paths(config.data.folder)


def make_objective(config) -> FlowMatching:
    folder = pipeline_folder(config)
    options = {k: v for k, v in dict(config.get("objective") or {}).items() if v is not None}
    scheduler = _json(folder / "scheduler" / "scheduler_config.json")
    return FlowMatching.from_scheduler_config(scheduler, **options)


def media(config, fam: Family) -> MediaDataset:
    if not config.data.get("folder"):
        raise ValueError(
            "data.folder is not set: give the folder of images and videos with captions "
            "(docs/finetune.md#media-folders)."
        )
    folder = pipeline_folder(config)
    configs = {"vae": _json(folder / "vae" / "config.json")}
    buckets = fam.buckets(configs, config.data)
    return MediaDataset(config.data.folder, buckets=buckets, on_bad=config.data.on_bad)


# -- the cache -----------------------------------------------------------------------------------
def _files_digest(folder: Path) -> str:
    """Names, sizes and modification times of the pipeline's files, the transformer aside."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and relative.parts[0] != "transformer":
            stat = path.stat()
            digest.update(f"{relative.as_posix()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def make_cache(config, fam: Family, dataset: MediaDataset) -> tuple[TensorCache, list[str]]:
    """The cache namespace of this pipeline, family and bucket rule; one key per file, then
    :data:`EMPTY_PROMPT`, as :class:`CacheSources` orders them."""
    folder = pipeline_folder(config)
    name = fingerprint(
        type(fam),  # names the folder: wan-<digest>
        pipeline=_files_digest(folder),
        buckets=dataclasses.asdict(dataset.buckets),
        version=CACHE_VERSION,
    )
    dtype = getattr(torch, config.data.cache_dtype)
    cache = TensorCache(config.data.cache_root, name, dtype=dtype)
    keys = []
    for file in dataset.files:
        stat = file.path.stat()
        identity = f"{file.path.relative_to(dataset.root)}|{stat.st_size}|{stat.st_mtime_ns}|{file.caption}"
        keys.append(hashlib.sha256(identity.encode()).hexdigest()[:24])
    return cache, [*keys, EMPTY_PROMPT]


EMPTY_PROMPT = "empty-prompt"  # the cache key of the empty caption's text embeddings


class CacheSources(Dataset):
    """What the cache encodes: the media dataset's ``(pixels, caption)`` samples, then the
    empty caption alone (``(None, "")``: text embeddings for caption dropout)."""

    def __init__(self, media: MediaDataset) -> None:
        self.media = media

    def __len__(self) -> int:
        return len(self.media) + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor | None, str]:
        return self.media[index] if index < len(self.media) else (None, "")


def encoder(config, fam: Family, device: torch.device):
    """``encode_fn`` of the cache: loads the pipeline without its transformer on first use,
    encodes the samples of each shape together."""
    pipe = None

    def encode(samples: list[tuple[torch.Tensor | None, str]]) -> list[dict[str, torch.Tensor]]:
        nonlocal pipe
        if pipe is None:
            pipe = load_pipeline(pipeline_folder(config), trained=(), transformer=None).to(device)
        by_shape: dict[tuple[int, ...] | None, list[int]] = {}
        for index, (pixels, _) in enumerate(samples):
            by_shape.setdefault(None if pixels is None else tuple(pixels.shape), []).append(index)
        out: list[dict[str, torch.Tensor]] = [{} for _ in samples]
        with torch.no_grad():
            for shape, indices in by_shape.items():
                tensors = fam.text(pipe, [samples[i][1] for i in indices])
                if shape is not None:
                    pixels = torch.stack([samples[i][0] for i in indices])
                    batch = config.data.encode_batch_size
                    tensors["latents"] = fam.latents(pipe, pixels, batch)
                for row, index in enumerate(indices):
                    out[index] = {name: value[row].cpu() for name, value in tensors.items()}
        return out

    return encode


def build_cache(config):
    """The hook of ``litegen cache build``: (cache, dataset, encode_fn, keys)."""
    fam = pipeline_family(config)
    dataset = media(config, fam)
    cache, keys = make_cache(config, fam, dataset)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return cache, CacheSources(dataset), encoder(config, fam, device), keys


class CachedSamples(Dataset):
    """The cached latents and text embeddings of the media files, by index."""

    collate_fn = staticmethod(default_collate)  # samples are dicts of tensors

    def __init__(self, cache: TensorCache, keys: list[str]) -> None:
        self.cache, self.keys = cache, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tensors = self.cache.get(self.keys[index])
        if tensors is None:
            raise ValueError(f"cache {self.cache.directory} lost entry {self.keys[index]}; rerun.")
        return tensors


def _device(config) -> torch.device:
    if config.runtime.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def cached_data(config, fam: Family) -> tuple[DataLoader, dict[str, torch.Tensor]]:
    """The media folder's samples from the cache, and the empty caption's text embeddings;
    what is missing is encoded first, by all ranks."""
    dataset = media(config, fam)
    cache, keys = make_cache(config, fam, dataset)
    missing = any(key not in cache for key in keys)
    if missing and config.runtime.device == "meta":
        raise ValueError(
            f"the cache {cache.directory} lacks samples and an estimate on the meta device "
            "encodes nothing; run `litegen cache build` with this recipe first."
        )
    if missing:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        fill_cache(
            cache,
            CacheSources(dataset),
            encoder(config, fam, _device(config)),
            keys=keys,
            batch_size=config.data.encode_batch_size,
            rank=rank,
            world_size=world,
        )
    if dist.is_initialized():
        dist.barrier()  # every rank's share is written before any rank reads
    cache.refresh()
    sampler = BucketBatchSampler(dataset.keys)
    samples = CachedSamples(cache, keys[: len(dataset)])
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=CachedSamples.collate_fn)
    return loader, cache.get(EMPTY_PROMPT)


@dataclasses.dataclass(frozen=True)
class CaptionDropout:
    """Each sample's text embeddings swapped for the empty caption's with ``probability``
    (drawn from the training RNG): the unconditional half classifier-free guidance samples
    with. Not indexable, so ``build``'s dict hands it to ``train_step`` as it is.

    Example:
        >>> batch = {"latents": torch.zeros(4, 2), "prompt_embeds": torch.ones(4, 3, 2)}
        >>> dropout = CaptionDropout(1.0, {"prompt_embeds": torch.zeros(3, 2)})
        >>> dropout(batch)["prompt_embeds"].sum()
        tensor(0.)
    """

    probability: float
    empty: dict[str, torch.Tensor]

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.probability <= 0:
            return batch
        some = next(iter(batch.values()))
        dropped = torch.rand(some.shape[0], device=some.device) < self.probability
        out = dict(batch)
        for name, value in self.empty.items():
            mask = dropped.view(-1, *([1] * value.dim()))
            out[name] = torch.where(mask, value.to(batch[name]), batch[name])
        return out


# -- training ------------------------------------------------------------------------------------
def build(config):
    """The pipeline's transformer, AdamW over what trains, the cached samples, the objective."""
    fam = pipeline_family(config)
    if config.trainer.sample_every and not config.trainer.validation.prompts:
        raise ValueError(
            "trainer.sample_every is set but trainer.validation.prompts is empty: give the "
            "prompts to sample, or set trainer.sample_every=0."
        )
    data, empty_prompt = cached_data(config, fam)
    model = load_transformer(config)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    return {
        "model": model,
        "optimizer": optimizer,
        "data": data,
        "family": fam,
        "objective": make_objective(config),
        "caption_dropout": CaptionDropout(float(config.data.caption_dropout), empty_prompt),
    }


def load_transformer(config) -> torch.nn.Module:
    """The pipeline's transformer; on the meta device when ``runtime.device`` is ``meta``
    (``litegen inspect-config --estimate``): built from its ``config.json``, no weights read."""
    folder = pipeline_folder(config)
    if config.runtime.device != "meta":
        return load_component(folder, "transformer")
    library, class_name = check_pipeline_folder(folder)["transformer"]
    cls = getattr(importlib.import_module(library), class_name)
    with torch.device("meta"):
        return cls.from_config(cls.load_config(folder / "transformer"))


def train_step(batch, model, family, objective, caption_dropout):
    """The flow-matching loss of one micro-batch of cached latents."""
    return family.loss(model, caption_dropout(batch), objective)


def sample(model, gen, config, family):
    """The validation prompts through the pipeline, with the weights being trained (or EMA).

    The VAE and text encoders (bf16 on a GPU) come to the device for the call and go back to
    the CPU after it, so training keeps their memory between samples.
    """
    global _sampling_pipe
    validation = config.trainer.validation
    if _sampling_pipe is None:
        dtype = torch.bfloat16 if gen.device.type == "cuda" else None
        folder = pipeline_folder(config)
        _sampling_pipe = load_pipeline(folder, trained=(), transformer=None, torch_dtype=dtype)
        _sampling_pipe.set_progress_bar_config(disable=True)
    _sampling_pipe.transformer = gen.unwrap(model)
    frozen = [
        module
        for name, module in _sampling_pipe.components.items()
        if isinstance(module, torch.nn.Module) and name != "transformer"
    ]
    for module in frozen:
        module.to(gen.device)
    try:
        generator = torch.Generator(gen.device).manual_seed(int(validation.seed))
        return family.sample(_sampling_pipe, list(validation.prompts), validation, generator)
    finally:
        for module in frozen:
            module.to("cpu")


def finish(gen, config, model):
    """Export (:func:`litegen.export.write_export`, as ``litegen export`` does from a
    checkpoint): the pipeline folder with the trained transformer, or the LoRA adapters."""
    use_ema = config.trainer.export_ema and gen.ema is not None
    lora = config.optimization.lora
    if use_ema:  # a LoRA model's EMA averages the adapters alone: no need to gather the base
        state = gen.ema.state_dict() if lora is not None else gen.full_ema_state()
    else:
        state = gen.full_model_state(model)  # every rank gathers
    out = Path(config.get_results_dir()) / ("lora" if lora is not None else "pipeline")
    if gen.is_main_process:
        name = export_name(config.exp_name, use_ema)
        prefix = lora.prefix if lora is not None else "transformer"
        write_export(gen.unwrap(model), state, pipeline_folder(config), out, name=name,
                     lora_prefix=prefix)  # fmt: skip
