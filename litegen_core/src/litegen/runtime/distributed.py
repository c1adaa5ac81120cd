"""Process-level setup: the torchrun environment, the process group, the device and the seeds.

Works the same under ``torchrun --nproc_per_node=N`` and as a plain single process (a
one-rank group backed by an in-memory store), so every later layer can assume a group exists.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from litegen.config import MainConfig


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells a worker about its place in the job.

    Example:
        >>> DistEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank
        1
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launched: bool = False  # True under torchrun (or any launcher that sets RANK)

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        if "RANK" not in environ:
            return cls()
        world_size = int(environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(environ["RANK"]),
            world_size=world_size,
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world_size))),
            launched=True,
        )


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
