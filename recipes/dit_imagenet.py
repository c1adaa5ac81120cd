"""Entry module of recipes/dit_imagenet.yaml: DiT-XL/2, class-conditional, on image latents.

    uv run litegen cache build recipes/dit_imagenet.yaml data.image_folder=DIR vae.path=VAE
    uv run litegen launch recipes/dit_imagenet.yaml data.image_folder=DIR vae.path=VAE

The model is diffusers' ``DiTTransformer2DModel`` with the configuration of
facebook/DiT-XL-2-256 (``model.size: xl``; ``tiny`` for CPU smoke runs), random weights
unless ``init_from`` names a checkpoint (a diffusers folder such as the pipeline's
``transformer/``). It learns the flow-matching velocity ``noise - x0`` with its first four output
channels from ``x_t = (1 - t) x0 + t noise``; the model itself replaces 10% of the labels by
its null class, for classifier-free guidance.

Data: with ``data.image_folder`` (one sub-folder of images per class, as ImageNet's train
split), ``build_cache`` centre-crops and resizes every image to ``data.resolution``, encodes it
with the VAE at ``vae.path`` (a diffusers ``AutoencoderKL`` folder) and stores the latent and
label in a ``litegen.cache.TensorCache``; training reads the cache only. Without an image
folder it trains on synthetic latents that depend on the class (so the loss falls), at one or
several sizes (``data.latent_sizes``): several sizes are grouped by LiteGen's bucket sampler,
one size per global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, default_collate

from litegen.cache import TensorCache, fingerprint
from litegen.data import BucketBatchSampler
from litegen.utils.encode import vae_encode

# Bump when the encoding below changes: code is not part of the cache's fingerprint.
ENCODING_VERSION = 1
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".JPEG"}

# facebook/DiT-XL-2-256's transformer (750M parameters in diffusers' layout); a tiny one.
MODELS: dict[str, dict[str, Any]] = {
    "xl": {
        "num_attention_heads": 16,
        "attention_head_dim": 72,
        "in_channels": 4,
        "out_channels": 8,
        "num_layers": 28,
        "sample_size": 32,
        "patch_size": 2,
        "num_embeds_ada_norm": 1000,
        "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False,
    },
    "tiny": {
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "in_channels": 4,
        "out_channels": 8,
        "num_layers": 2,
        "sample_size": 8,
        "patch_size": 2,
        "num_embeds_ada_norm": 10,
    },
}


def build_model(config):
    """The DiT of ``model.size``, with random weights (``init_from`` is applied by prepare)."""
    from diffusers import DiTTransformer2DModel

    size = config.model.size
    if size not in MODELS:
        raise ValueError(f"model.size must be one of {sorted(MODELS)}, got {size!r}.")
    return DiTTransformer2DModel(**MODELS[size])


# -- data ----------------------------------------------------------------------------------------
class ImageFolder(Dataset):
    """(image in [-1, 1] of shape 3 x R x R, label): one sub-folder of images per class."""

    def __init__(self, root: str | Path, resolution: int) -> None:
        root = Path(root)
        classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        self.files = [
            (path, label)
            for label, name in enumerate(classes)
            for path in sorted((root / name).iterdir())
            if path.suffix in IMAGE_SUFFIXES
        ]
        if not self.files:
            raise ValueError(
                f"data.image_folder {root} holds no images in class sub-folders "
                f"({', '.join(sorted(IMAGE_SUFFIXES))}); point it to a folder like ImageNet's "
                "train/ (one folder per class)."
            )
        self.resolution = resolution

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import numpy as np
        from PIL import Image

        path, label = self.files[index]
        with Image.open(path) as image:
            image = image.convert("RGB")
            # ADM's centre crop: shrink the short side to the resolution, then crop the middle.
            scale = self.resolution / min(image.size)
            size = (round(image.width * scale), round(image.height * scale))
            image = image.resize(size, Image.BICUBIC)
            left, top = (size[0] - self.resolution) // 2, (size[1] - self.resolution) // 2
            image = image.crop((left, top, left + self.resolution, top + self.resolution))
            pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
        return pixels.float() / 127.5 - 1.0, label


def load_vae(config):
    """The diffusers AutoencoderKL at ``vae.path`` (``vae.subfolder`` inside it, if set)."""
    from diffusers import AutoencoderKL

    if not config.vae.path:
        raise ValueError(
            "data.image_folder needs vae.path: a diffusers AutoencoderKL folder (for DiT, "
            "stabilityai/sd-vae-ft-ema), or a pipeline folder with vae.subfolder=vae."
        )
    vae = AutoencoderKL.from_pretrained(config.vae.path, subfolder=config.vae.subfolder)
    return vae.to("cuda" if torch.cuda.is_available() else "cpu").eval().requires_grad_(False)


def make_cache(config, vae) -> TensorCache:
    """The latent cache, in a folder named after the VAE's weights and the encoding settings."""
    key = fingerprint(
        vae,
        resolution=config.data.resolution,
        crop="center",
        sample="mode",
        dtype=config.latent_cache.dtype,
        version=ENCODING_VERSION,
    )
    return TensorCache(
        config.latent_cache.root, key, dtype=getattr(torch, config.latent_cache.dtype)
    )


def build_cache(config):
    """The hook of ``litegen cache build``: (cache, dataset, encode_fn), see docs/cli.md."""
    vae = load_vae(config)
    images = ImageFolder(config.data.image_folder, config.data.resolution)

    def encode(samples: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
        pixels = torch.stack([image for image, _ in samples])
        latents = vae_encode(
            vae, pixels, micro_batch_size=config.vae.micro_batch_size, sample=False
        )
        return {"latent": latents.cpu(), "label": torch.tensor([label for _, label in samples])}

    return make_cache(config, vae), images, encode


class CachedLatents(Dataset):
    """Latents and labels that ``litegen cache build`` stored, by dataset index."""

    collate_fn = staticmethod(default_collate)  # samples are dicts of tensors

    def __init__(self, cache: TensorCache, command: str) -> None:
        self.cache = cache
        self.keys = sorted(map(int, cache.keys()))
        if not self.keys:
            raise ValueError(f"the latent cache {cache.directory} is empty; run {command} first.")

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        entry = self.cache.get(self.keys[index])
        if entry is None:
            raise ValueError(f"latent {self.keys[index]} is missing from {self.cache.directory}.")
        return {"latents": entry["latent"].float(), "label": entry["label"]}


class SyntheticLatents(Dataset):
    """Latents that depend on the class: a fixed 4 x 4 pattern per class, upsampled to the
    sample's size, plus noise. Sample ``i`` has class ``i % classes`` and size
    ``sizes[(i // classes) % len(sizes)]``, and is the same in every epoch and on every rank."""

    collate_fn = staticmethod(default_collate)  # samples are dicts of tensors

    def __init__(self, samples: int, sizes: list[int], classes: int, channels: int = 4) -> None:
        self.samples, self.sizes, self.classes = samples, list(sizes), classes
        self.patterns = torch.randn(
            classes, channels, 4, 4, generator=torch.Generator().manual_seed(0)
        )

    def size_of(self, index: int) -> int:
        return self.sizes[(index // self.classes) % len(self.sizes)]

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        label, size = index % self.classes, self.size_of(index)
        gen = torch.Generator().manual_seed(index + 1)
        pattern = F.interpolate(self.patterns[label][None], size=(size, size), mode="bilinear")[0]
        noise = torch.randn(pattern.shape, generator=gen)
        return {"latents": pattern + 0.5 * noise, "label": torch.tensor(label)}


def build_data(config) -> Dataset | DataLoader:
    """The cached latents of ``data.image_folder``, or synthetic ones (bucketed by size)."""
    data = config.data
    if data.image_folder:
        command = "`litegen cache build recipes/dit_imagenet.yaml` with the same data and vae"
        return CachedLatents(make_cache(config, load_vae(config)), command)
    classes = MODELS[config.model.size]["num_embeds_ada_norm"]
    dataset = SyntheticLatents(data.synthetic_samples, data.latent_sizes, classes)
    if len(dataset.sizes) == 1:
        return dataset
    keys = [dataset.size_of(i) for i in range(len(dataset))]
    return DataLoader(
        dataset,
        batch_sampler=BucketBatchSampler(keys),
        num_workers=config.num_workers,
        pin_memory=config.pin_memory,
    )


# -- training ------------------------------------------------------------------------------------
def build(config):
    """The DiT, AdamW (constant learning rate, as DiT was trained) and the latents."""
    model = build_model(config)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    return {"model": model, "optimizer": optimizer, "data": build_data(config)}


def train_step(batch, model):
    """Flow-matching loss on the first four output channels (the rest is DiT's learned sigma).

    The model drops 10% of the labels to its null class itself (diffusers' label embedding,
    in training mode), which classifier-free guidance needs.
    """
    x0, labels = batch["latents"], batch["label"]
    t = torch.rand(x0.shape[0], device=x0.device)
    noise = torch.randn_like(x0)
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
    dtype = next(model.parameters()).dtype  # bf16 under the bf16-mixed preset
    out = model(x_t.to(dtype), timestep=t * 1000, class_labels=labels, return_dict=False)[0]
    return F.mse_loss(out[:, : x0.shape[1]].float(), (noise - x0).float())
