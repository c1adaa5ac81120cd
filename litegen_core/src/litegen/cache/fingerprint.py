"""Fingerprints name a cache namespace after the encoder and the settings that produced it."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from typing import Any

import torch
from torch import nn

__all__ = ["fingerprint"]


def fingerprint(encoder: Any = None, **settings: Any) -> str:
    """A directory-safe name that changes whenever the encoder or its settings change.

    Hashes the encoder's class, every tensor of its ``state_dict`` (name, dtype, shape and
    bytes) and ``settings`` (JSON, keys sorted; other values by ``str``). Pass everything
    that changes the output: resolution, crop, dtype, prompt template, a version string
    for hand-written transforms. For a plain function only its qualified name is hashed,
    so bump a ``version=`` setting when its code changes.

    Example:
        >>> vae = nn.Linear(4, 2)  # any encoder module
        >>> fp = fingerprint(vae, resolution=256, sample="mode")
        >>> fp.startswith("linear-"), fp == fingerprint(vae, resolution=512, sample="mode")
        (True, False)
    """
    digest = hashlib.sha256()
    label = "settings"
    module = encoder
    if inspect.ismethod(encoder) and isinstance(encoder.__self__, nn.Module):
        module = encoder.__self__  # vae.encode: fingerprint the VAE and the method name
        digest.update(encoder.__name__.encode())
    if encoder is not None:
        cls = type(module) if isinstance(module, nn.Module) else module
        label = getattr(cls, "__name__", type(cls).__name__)
        digest.update(f"{getattr(cls, '__module__', '')}.{label}".encode())
    if isinstance(module, nn.Module):
        for name, tensor in module.state_dict().items():
            if not isinstance(tensor, torch.Tensor):
                continue  # extra state objects carry no weights
            tensor = tensor.detach().to("cpu").contiguous()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "encoder"
    return f"{slug}-{digest.hexdigest()[:16]}"
