"""Sliced VAE encoding: encode a large batch a few samples at a time.

Encoding a whole training batch (or a whole dataset shard) through a VAE at once
needs activation memory for every sample together; slicing bounds peak memory by
one slice while giving the same latents. The public path is the spec's,
``litegen.utils.encode`` (:data:`litegen.utils.moved_modules.PUBLIC_PATHS`); the module lives
with the data it encodes, in the layer of its imports.

    from litegen.utils.encode import vae_encode

    latents = vae_encode(vae, pixels, micro_batch_size=8)  # (B, C', H/8, W/8)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["vae_encode"]

Generators = torch.Generator | Sequence[torch.Generator] | None


@torch.no_grad()
def vae_encode(
    vae: nn.Module | Callable[[torch.Tensor], Any],
    x: torch.Tensor,
    *,
    micro_batch_size: int,
    sample: bool = True,
    generator: Generators = None,
    scale: bool = True,
    frames: Literal["auto", "fold", "video"] = "auto",
    scaling_factor: float | None = None,
    shift_factor: float | None = None,
) -> torch.Tensor:
    """Encode ``x`` through ``vae`` in slices of ``micro_batch_size`` under ``torch.no_grad()``.

    Args:
        vae: a module with ``encode`` (diffusers VAEs and the like), or any callable.
            ``encode`` may return a diffusers output (``.latent_dist``), a distribution
            (``.sample()``/``.mode()``), a tuple whose first item is one of those, or a tensor.
        x: images ``(B, C, H, W)`` or videos ``(B, C, T, H, W)``. Slices are moved to the
            VAE's device and floating dtype one at a time, so ``x`` may stay on the CPU.
        micro_batch_size: most items per VAE call: images for 2-D VAEs (video frames count
            one each when folded), clips for video VAEs.
        sample: draw ``mean + std * noise`` from the latent distribution; ``False`` uses
            its mode (the mean). Plain tensor outputs are returned as they are.
        generator: one ``torch.Generator`` for the whole batch, or a list with one per
            sample (per clip for videos). Noise is drawn once for the whole batch after
            encoding, so any ``micro_batch_size`` gives the same latents, and they match
            ``vae.encode(x).latent_dist.sample(generator)`` on the whole batch.
        scale: apply ``(z - shift_factor) * scaling_factor`` from ``vae.config`` (missing
            values count as shift 0 and scale 1).
        frames: for 5-D input, ``"fold"`` folds frames into the batch for 2-D VAEs,
            ``"video"`` passes whole clips to video VAEs, ``"auto"`` picks ``"video"`` when
            the VAE has a ``Conv3d`` layer.
        scaling_factor / shift_factor: override the values from ``vae.config``.

    Returns:
        Latents, ``(B, C', h, w)`` or ``(B, C', t, h, w)``, on the VAE's device.

    Example:
        >>> from diffusers import AutoencoderKL
        >>> vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
        >>> pixels = torch.randn(4, 3, 16, 16)
        >>> gens = [torch.Generator().manual_seed(i) for i in range(4)]
        >>> vae_encode(vae, pixels, micro_batch_size=2, generator=gens).shape
        torch.Size([4, 4, 16, 16])
    """
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if x.dim() not in (4, 5):
        raise ValueError(
            f"vae_encode expects images (B, C, H, W) or videos (B, C, T, H, W), got shape "
            f"{tuple(x.shape)}; add the missing batch dimension with x.unsqueeze(0)"
        )
    batch = x.shape[0]
    if isinstance(generator, Sequence) and len(generator) != batch:
        raise ValueError(
            f"got {len(generator)} generators for {batch} samples; pass one per sample "
            "or a single torch.Generator"
        )

    fold = x.dim() == 5 and not _is_video(vae, frames)
    num_items = batch * x.shape[2] if fold else batch
    encode = _encode_fn(vae)
    device, dtype = _device_dtype(vae)

    means: list[torch.Tensor] = []
    stds: list[torch.Tensor | None] = []
    for start in range(0, num_items, micro_batch_size):
        stop = min(start + micro_batch_size, num_items)
        piece = _folded_slice(x, start, stop) if fold else x[start:stop]
        if device is not None:
            piece = piece.to(device, dtype if piece.is_floating_point() else None)
        mean, std = _latent(encode(piece), sample, generator, start, stop, fold)
        means.append(mean)
        stds.append(std)

    z = torch.cat(means)
    std = None if any(s is None for s in stds) else torch.cat(stds)  # type: ignore[arg-type]
    if fold:
        z = _unfold(z, batch)
        std = None if std is None else _unfold(std, batch)
    if sample and std is not None:
        # Draw noise for the whole batch at once: the slicing then cannot change it.
        z = z + std * _randn(z.shape, generator, z.device, z.dtype)

    if scale:
        config = getattr(vae, "config", None)
        shift = shift_factor if shift_factor is not None else _config_value(config, "shift_factor")
        factor = (
            scaling_factor
            if scaling_factor is not None
            else _config_value(config, "scaling_factor")
        )
        if shift is not None:
            z = z - shift
        if factor is not None:
            z = z * factor
    return z


def _is_video(vae: Any, frames: str) -> bool:
    if frames in ("fold", "video"):
        return frames == "video"
    if frames != "auto":
        raise ValueError(f"frames must be 'auto', 'fold' or 'video', got {frames!r}")
    module = _module_of(vae)
    if module is None:
        raise ValueError(
            "cannot tell whether this VAE encodes videos or images; pass frames='video' "
            "(whole clips per call) or frames='fold' (frames folded into the batch)"
        )
    # Video VAEs convolve over time; 2-D VAEs have no 3-D convolutions.
    return any(isinstance(m, nn.Conv3d) for m in module.modules())


def _module_of(vae: Any) -> nn.Module | None:
    if isinstance(vae, nn.Module):
        return vae
    if inspect.ismethod(vae) and isinstance(vae.__self__, nn.Module):
        return vae.__self__  # the caller passed vae.encode
    return None


def _encode_fn(vae: Any) -> Callable[[torch.Tensor], Any]:
    encode = getattr(vae, "encode", None)
    if callable(encode):
        return encode
    if callable(vae):
        return vae
    raise ValueError(f"{type(vae).__name__} has no encode() and is not callable; pass a VAE")


def _device_dtype(vae: Any) -> tuple[torch.device | None, torch.dtype | None]:
    module = _module_of(vae)
    param = None if module is None else next(module.parameters(), None)
    if param is None:
        return None, None
    return param.device, param.dtype


def _folded_slice(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Frames ``start:stop`` of ``x`` (B, C, T, H, W) seen as (B*T, C, H, W), copying only those."""
    frames = x.shape[2]
    pieces = []
    k = start
    while k < stop:
        clip, t = divmod(k, frames)
        n = min(stop - k, frames - t)
        pieces.append(x[clip, :, t : t + n].transpose(0, 1))
        k += n
    return torch.cat(pieces)


def _unfold(z: torch.Tensor, batch: int) -> torch.Tensor:
    """(B*T, C', h, w) -> (B, C', T, h, w)."""
    return z.reshape(batch, -1, *z.shape[1:]).transpose(1, 2).contiguous()


def _latent(
    out: Any, sample: bool, generator: Generators, start: int, stop: int, fold: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean, std) of one slice's output; std is None when noise is already applied or absent."""
    if isinstance(out, tuple | list):
        out = out[0]
    if hasattr(out, "latent_dist"):
        out = out.latent_dist
    elif hasattr(out, "latents") and isinstance(out.latents, torch.Tensor):
        out = out.latents
    if isinstance(out, torch.Tensor):
        return out, None
    mean, std = getattr(out, "mean", None), getattr(out, "std", None)
    if isinstance(mean, torch.Tensor) and isinstance(std, torch.Tensor):
        return mean, std  # Gaussian: noise is added after all slices are encoded
    if not sample:
        return out.mode(), None
    # Some other distribution: sample slice by slice, which agrees with a whole-batch
    # draw only for per-sample generators of unfolded inputs.
    if not isinstance(generator, Sequence):
        return out.sample(generator=generator), None
    if fold:
        raise ValueError(
            f"per-sample generators need a Gaussian latent (.mean/.std) when frames are "
            f"folded; {type(out).__name__} has none: pass one torch.Generator or frames='video'"
        )
    return out.sample(generator=list(generator[start:stop])), None


def _randn(
    shape: torch.Size, generator: Generators, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Noise like diffusers' ``randn_tensor``: a generator list seeds each sample on its own."""
    if isinstance(generator, Sequence):
        if len(generator) == 1:
            generator = generator[0]
        else:
            return torch.cat([_randn((1, *shape[1:]), g, device, dtype) for g in generator])
    rand_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=rand_device, dtype=dtype).to(device)


def _config_value(config: Any, name: str) -> float | None:
    if config is None:
        return None
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    return None if value is None else float(value)
