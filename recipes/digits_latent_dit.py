"""Entry module of recipes/digits_latent_dit.yaml: a class-conditional DiT on cached latents.

    uv run litegen launch recipes/digits_autoencoder.yaml   # stage 1: the autoencoder
    uv run litegen launch recipes/digits_latent_dit.yaml    # stage 2: this module

Stage 2 of the latent-diffusion pipeline (docs/recipes.md). The digits are encoded by the
stage-1 autoencoder through ``vae_encode`` (micro-batched) and the latents are kept in a
``litegen.cache.TensorCache`` named after a fingerprint of the autoencoder's weights, so a
retrained autoencoder never serves stale latents. The cache is filled lazily: during the
first epoch every rank encodes the misses of its own batches (``get_or_compute``) and writes
them as a shard at the end of the epoch; later epochs and later runs only read.
``litegen cache build`` fills it ahead instead, through :func:`build_cache`.

The DiT is trained with rectified flow on the latents (as recipes/digits_dit.py does on
pixels); ``finish`` samples latents, decodes them with the autoencoder and writes a grid.
Rank 0 prints the cache statistics and epoch times and appends them to
``<results_dir>/cache_epochs.jsonl``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from digits_autoencoder import DigitsAutoencoder
from digits_dit import (
    NUM_CLASSES,
    Digits,
    euler_sample,
    flow_loss,
    make_dit,
    make_optimizer,
    save_grid,
)

from litegen.cache import TensorCache, fingerprint
from litegen.utils.encode import vae_encode

# Bump when the encoding code below changes: code is not part of the fingerprint.
ENCODING_VERSION = 1


class LatentCodec:
    """The frozen autoencoder plus the shift and scale that make its latents ~N(0, 1).

    Rectified flow starts from unit Gaussian noise, so the latents are standardized as
    latent-diffusion models do: ``(z - shift) * scale``, measured once on a few digits.
    """

    def __init__(
        self, autoencoder: DigitsAutoencoder, stats_images: torch.Tensor, micro_batch_size: int
    ):
        self.autoencoder = autoencoder
        self.micro_batch_size = micro_batch_size
        raw = vae_encode(autoencoder, stats_images, micro_batch_size=micro_batch_size, scale=False)
        self.shift = float(raw.mean())
        self.scale = float(1.0 / raw.std())
        self.latent_shape = tuple(raw.shape[1:])  # (channels, 4, 4)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1, 8, 8) images -> standardized latents, a micro-batch at a time."""
        return vae_encode(
            self.autoencoder,
            images,
            micro_batch_size=self.micro_batch_size,
            shift_factor=self.shift,
            scaling_factor=self.scale,
        )

    def encode_samples(self, samples: list[tuple[torch.Tensor, Any]]) -> dict[str, torch.Tensor]:
        """``encode_fn`` of the cache: ``Digits`` samples -> {"latent": latents, batched}."""
        return {"latent": self.encode(torch.stack([image for image, _label in samples]))}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Standardized latents -> images in [-1, 1]."""
        return self.autoencoder.decode(latents / self.scale + self.shift)


def load_codec(config) -> LatentCodec:
    """Load the stage-1 autoencoder from ``autoencoder.checkpoint`` and measure its latents."""
    autoencoder = DigitsAutoencoder.from_checkpoint(config.autoencoder.checkpoint)
    stats_images = Digits().images[: config.latent_cache.stats_samples]
    return LatentCodec(autoencoder, stats_images, config.latent_cache.micro_batch_size)


def make_cache(config, codec: LatentCodec) -> TensorCache:
    """The latent cache, in a folder named after the autoencoder's weights and our settings."""
    dtype_name = config.latent_cache.dtype
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"latent_cache.dtype: unknown dtype {dtype_name!r}; use bfloat16, float16 or float32."
        )
    # The weights are hashed, so the shift and scale (derived from them) need no entry here.
    key = fingerprint(
        codec.autoencoder,
        data="sklearn-digits-8x8-minus1to1",
        stats_samples=config.latent_cache.stats_samples,
        dtype=dtype_name,
        version=ENCODING_VERSION,
    )
    return TensorCache(config.latent_cache.root, key, dtype=dtype)


def build_cache(
    config,
) -> tuple[TensorCache, Digits, Callable[[list[Any]], dict[str, torch.Tensor]]]:
    """The hook of ``litegen cache build``: (cache, dataset, encode_fn), see docs/cli.md."""
    codec = load_codec(config)
    return make_cache(config, codec), Digits(), codec.encode_samples


class DigitIndices(torch.utils.data.Dataset):
    """(index, label) pairs: train_step turns the indices into latents through the cache."""

    def __init__(self, labels: torch.Tensor) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.labels[index]


class CachedLatents:
    """Latents by dataset index: read from the cache, encoded and stored on a miss.

    Also keeps the per-epoch books: at each epoch boundary every rank writes its new entries
    as a shard (so later epochs and other ranks find them) and rank 0 reports the epoch's
    time and the cache statistics summed over the ranks.
    """

    def __init__(
        self, cache: TensorCache, dataset: Digits, codec: LatentCodec, config, is_main: bool
    ):
        self.cache = cache
        self.dataset = dataset
        self.codec = codec
        self.steps_per_epoch = len(dataset) / config.global_batch_size
        self.is_main = is_main
        self.log_path = Path(config.get_results_dir()) / "cache_epochs.jsonl"
        self.epoch = 0
        self.epoch_start: tuple[float, int] | None = None  # (time, step), set by the first lookup
        self.encode_s = 0.0  # in the autoencoder, for misses
        self.lookup_s = 0.0  # in get_or_compute: cache reads plus encoding
        # Totals at the last report: each epoch's record holds the difference.
        self.reported_counts = torch.zeros(4, dtype=torch.float64)
        self.reported_times = torch.zeros(2, dtype=torch.float64)
        self.history: list[dict[str, Any]] = []

    def lookup(self, indices: torch.Tensor, step: int) -> torch.Tensor:
        """Latents of these dataset indices (float32), for training step ``step`` (0-based)."""
        # Epoch of the step's first sample; the step that crosses a boundary counts to the
        # epoch it started in, so "epoch 1" is the steps that fill the cache.
        epoch = int(step / self.steps_per_epoch)
        if self.epoch_start is None:
            self.epoch, self.epoch_start = epoch, (time.perf_counter(), step)
        elif epoch != self.epoch:
            self.end_epoch(step)
            self.epoch = epoch
        start = time.perf_counter()
        out = self.cache.get_or_compute(indices.tolist(), self._encode_missing)
        self.lookup_s += time.perf_counter() - start
        return torch.stack([entry["latent"] for entry in out]).float()

    def _encode_missing(self, keys: list[str]) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        latents = self.codec.encode_samples([self.dataset[int(key)] for key in keys])
        self.encode_s += time.perf_counter() - start
        return latents

    def end_epoch(self, step: int, partial: bool = False) -> None:
        """Write this rank's new entries, then report the epoch (a collective: every rank)."""
        self.cache.flush()
        stats = self.cache.stats
        totals = torch.tensor(
            [stats.hits, stats.misses, stats.bytes_written, stats.bytes_read],
            dtype=torch.float64,
        )
        times = torch.tensor([self.encode_s, self.lookup_s], dtype=torch.float64)
        dist.all_reduce(totals)  # summed over the ranks
        dist.all_reduce(times)  # seconds of all ranks together
        counts, self.reported_counts = totals - self.reported_counts, totals
        seconds, self.reported_times = times - self.reported_times, times
        now = time.perf_counter()
        start_time, start_step = self.epoch_start
        self.epoch_start = (now, step)
        hits, misses, written, read = (int(v) for v in counts.tolist())
        record = {
            "epoch": self.epoch + 1,
            "partial": partial,
            "steps": step - start_step,
            "seconds": round(now - start_time, 3),
            "hits": hits,
            "misses": misses,
            "bytes_written": written,
            "bytes_read": read,
            "encode_s": round(float(seconds[0]), 3),
            "lookup_s": round(float(seconds[1]), 3),
        }
        self.history.append(record)
        if not self.is_main:
            return
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if record["epoch"] <= 3 or partial:
            print(
                f"cache: epoch {record['epoch']}{' (partial)' if partial else ''}: "
                f"{record['steps']} steps in {record['seconds']:.2f} s, {record['hits']} hits, "
                f"{record['misses']} misses (encoding {record['encode_s']:.2f} s, cache lookups "
                f"{record['lookup_s']:.2f} s, summed over ranks), "
                f"{record['bytes_written']} bytes written, {record['bytes_read']} bytes read",
                flush=True,
            )


def build(config):
    """The DiT, its optimizer, the digit indices and the cached latents they map to."""
    codec = load_codec(config)
    cache, dataset = make_cache(config, codec), Digits()
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    latents = CachedLatents(cache, dataset, codec, config, is_main)
    if is_main:
        print(
            f"cache: {cache.directory} holds {len(cache)} of {len(dataset)} latents "
            f"{latents.codec.latent_shape} ({cache.dtype}) before training",
            flush=True,
        )
        latents.log_path.parent.mkdir(parents=True, exist_ok=True)
        latents.log_path.unlink(missing_ok=True)  # this run's epochs only
    model = make_dit(config, *latents.codec.latent_shape[:2])
    optimizer, scheduler = make_optimizer(model, config)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "dataset": DigitIndices(dataset.labels),
        "latents": latents,  # neither model nor dataset: reaches train_step as it is
    }


def train_step(batch, model, latents, config, step):
    """Rectified-flow loss on the cached latents of one micro-batch, labels dropped for guidance."""
    indices, labels = batch
    # The trainer counts steps from 1; the cache's epochs are counted from step index 0.
    cached = latents.lookup(indices, step - 1).to(labels.device)
    return flow_loss(model, cached, labels, config)


@torch.no_grad()
def finish(latents, gen, config, step):
    """Report the last (partial) epoch and the totals; rank 0 decodes a grid of EMA samples."""
    if latents.epoch_start is not None and step > latents.epoch_start[1]:
        latents.end_epoch(step, partial=True)  # collective: every rank
    ema_state = gen.full_sampling_state()  # collective: every rank calls it
    if not gen.is_main_process:
        return
    later_full = [r for r in latents.history[1:] if not r["partial"]]
    if later_full:
        first = latents.history[0]
        mean = sum(r["seconds"] for r in later_full) / len(later_full)
        print(
            f"cache: first epoch {first['seconds']:.2f} s, later epochs {mean:.2f} s on average "
            f"({len(later_full)} epochs)",
            flush=True,
        )
    sampler = make_dit(config, *latents.codec.latent_shape[:2])
    sampler.load_state_dict(ema_state)
    sampler.eval()
    per_class = config.sampling.per_class
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    z = euler_sample(
        sampler,
        labels,
        config.sampling.steps,
        config.sampling.guidance,
        config.global_seed,
        shape=latents.codec.latent_shape,
    )
    images = latents.codec.decode(z)
    save_grid(
        images.reshape(NUM_CLASSES, per_class, 8, 8), Path(config.get_results_dir()) / "samples.png"
    )
