"""Entry module of recipes/wan_video.yaml: Wan 2.1 (1.3B) text-to-video on video latents.

    uv run litegen launch recipes/wan_video.yaml data.latent_folder=DIR

The model is diffusers' ``WanTransformer3DModel`` with the configuration of
Wan-AI/Wan2.1-T2V-1.3B-Diffusers (``model.size: 1.3b``; ``tiny`` for CPU smoke runs), random
weights unless ``init_from`` names a checkpoint (the pipeline's ``transformer/`` folder). It
learns the flow-matching velocity ``noise - x0`` from ``x_t = (1 - t) x0 + t noise``, with
``t`` uniform in [0, 1] and the text embeddings as cross-attention context.

Data: ``data.latent_folder`` holds one ``.safetensors`` file per clip, written by your own
encoding (Wan's VAE for the video, umT5 for the caption)::

    save_file({"latents": z,        # (16, frames, height, width), normalised as Wan does
               "text": embedding},  # (512, 4096): umT5's output, padded to 512 tokens
              f"{folder}/{clip_id}.safetensors")

Clips of several sizes (durations, resolutions) are grouped by LiteGen's bucket sampler, one
size per global batch. Without a folder the recipe trains on synthetic latents of
``data.frames x data.height x data.width`` (81 frames at 480 x 832 by default) with 512 x 4096
text embeddings; each of ``data.prompts`` prompts has its own embedding and latent pattern, so
the loss falls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, default_collate

from litegen.data import BucketBatchSampler
from litegen.families.wan import Wan

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers' transformer (the Wan family's), and the family's tiny one
# with the published latent channels, which this recipe's data has.
MODELS: dict[str, dict[str, Any]] = {
    "1.3b": Wan.reference_config,
    "tiny": {**Wan.tiny_config, "in_channels": 16, "out_channels": 16},
}


def build_model(config):
    """The Wan transformer of ``model.size``, random weights (prepare applies ``init_from``)."""
    from diffusers import WanTransformer3DModel

    size = str(config.model.size)
    if size not in MODELS:
        raise ValueError(f"model.size must be one of {sorted(MODELS)}, got {size!r}.")
    return WanTransformer3DModel(**MODELS[size])


# -- data ----------------------------------------------------------------------------------------
class LatentFiles(Dataset):
    """One clip per ``.safetensors`` file: {"latents": (C, F, H, W), "text": (L, D)}."""

    collate_fn = staticmethod(default_collate)  # samples are dicts of tensors

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.files = sorted(Path(folder).glob("*.safetensors"))
        if not self.files:
            raise ValueError(
                f"data.latent_folder {folder} holds no .safetensors files; write one per clip "
                'with {"latents": (16, F, H, W), "text": (512, 4096)} (see wan_video.py).'
            )
        self.shapes = []
        for path in self.files:  # shapes come from the headers: nothing is loaded
            with safe_open(str(path), framework="pt") as handle:
                if not {"latents", "text"} <= set(handle.keys()):
                    raise ValueError(f"{path} must hold tensors 'latents' and 'text'.")
                self.shapes.append(tuple(handle.get_slice("latents").get_shape()))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        tensors = load_file(str(self.files[index]))
        return {"latents": tensors["latents"].float(), "text": tensors["text"].float()}


class SyntheticClips(Dataset):
    """Clips of one size; clip ``i`` shows prompt ``i % prompts``: that prompt's text embedding
    and its latent pattern (3 x 4 x 4, upsampled to the clip) plus noise."""

    collate_fn = staticmethod(default_collate)  # samples are dicts of tensors

    def __init__(self, samples: int, prompts: int, shape: tuple[int, ...], text: tuple[int, int]):
        self.samples, self.prompts, self.shape, self.text = samples, prompts, shape, text
        gen = torch.Generator().manual_seed(0)
        self.patterns = torch.randn(prompts, shape[0], 3, 4, 4, generator=gen)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        prompt = index % self.prompts
        pattern = F.interpolate(self.patterns[prompt][None], size=self.shape[1:], mode="trilinear")
        noise = torch.randn(self.shape, generator=torch.Generator().manual_seed(index + 1))
        text = torch.randn(self.text, generator=torch.Generator().manual_seed(-prompt - 1))
        return {"latents": pattern[0] + 0.5 * noise, "text": text}


def build_data(config, text_dim: int) -> Dataset | DataLoader:
    """The clips of ``data.latent_folder`` (bucketed by size when sizes differ), or synthetic."""
    data = config.data
    if data.latent_folder:
        clips = LatentFiles(data.latent_folder)
        if len(set(clips.shapes)) == 1:
            return clips
        return DataLoader(
            clips,
            batch_sampler=BucketBatchSampler(clips.shapes),
            num_workers=config.num_workers,
            pin_memory=config.pin_memory,
        )
    shape = (16, data.frames, data.height, data.width)
    return SyntheticClips(data.synthetic_samples, data.prompts, shape, (data.text_tokens, text_dim))


# -- training ------------------------------------------------------------------------------------
def build(config):
    """The Wan transformer, AdamW and the clips."""
    model = build_model(config)
    _, ph, pw = model.config.patch_size
    # tokens/s in the logs: the transformer's sequence length per clip.
    model.tokens_per_sample = (
        config.data.frames * (config.data.height // ph) * (config.data.width // pw)
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    return {
        "model": model,
        "optimizer": optimizer,
        "data": build_data(config, model.config.text_dim),
    }


def train_step(batch, model):
    """Flow-matching loss of one micro-batch of clips."""
    x0, text = batch["latents"], batch["text"]
    t = torch.rand(x0.shape[0], device=x0.device)
    noise = torch.randn_like(x0)
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
    dtype = next(model.parameters()).dtype  # bf16 under the bf16-mixed preset
    out = model(
        x_t.to(dtype), timestep=t * 1000, encoder_hidden_states=text.to(dtype), return_dict=False
    )[0]
    return F.mse_loss(out.float(), (noise - x0).float())
