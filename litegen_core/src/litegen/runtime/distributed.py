"""Process-level setup: the process group, the device and the seeds, for a worker whose place in
the job is a :class:`DistEnv` (torchrun's variables; defined in :mod:`litegen.parallel.plan`
beside the plan it shapes, and importable from here).

Works the same under ``torchrun --nproc_per_node=N`` and as a plain single process (a
one-rank group backed by an in-memory store), so every later layer can assume a group exists.
"""

from __future__ import annotations

import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from litegen.config import MainConfig
from litegen.parallel.plan import DistEnv

__all__ = [
    "DistEnv",
    "init_process_group",
    "resolve_backend",
    "resolve_device",
    "seed_everything",
    "set_tf32",
]


def resolve_device(config: MainConfig, env: DistEnv) -> torch.device:
    """The device of this rank: ``runtime.device``, else CUDA when available, else CPU."""
    kind = config.runtime.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "npu":
        raise NotImplementedError("runtime.device 'npu' is reserved; use 'cuda' or 'cpu'.")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "runtime.device is 'cuda' but no CUDA device is visible; "
                "set runtime.device: cpu to train on the CPU."
            )
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def resolve_backend(config: MainConfig, device: torch.device) -> str:
    return config.runtime.distributed.backend or ("nccl" if device.type == "cuda" else "gloo")


def init_process_group(config: MainConfig, env: DistEnv, device: torch.device) -> None:
    """Join the job's process group, or make a one-rank group when run as a plain process."""
    if dist.is_initialized():
        return
    backend = resolve_backend(config, device)
    timeout = timedelta(seconds=config.runtime.distributed.dist_timeout)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if env.launched:
        dist.init_process_group(
            backend,
            init_method=config.runtime.distributed.dist_url,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            **kwargs,
        )
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs
        )


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_tf32(enabled: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
