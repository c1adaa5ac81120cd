"""What ``litegen launch`` runs inside each worker: the entry module, built, prepared, trained.

Example::

    run_entry(MainConfig.load_yaml("recipes/digits_dit.yaml"), "digits_dit.py", "recipes")
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from litegen.config import MainConfig
from litegen.entry import load_entry, parts_to_prepare
from litegen.loggers import check_loggers
from litegen.runtime.litegen import LiteGen, initialize
from litegen.trainer.hooks import check_hooks, keyword_filter
from litegen.trainer.loop import Trainer


def run_entry(config: MainConfig, entry: str, base_dir: str | Path | None = None) -> list[float]:
    """Everything ``litegen launch`` does inside one worker: build, prepare, train, finish.

    The entry module's ``build(config)`` returns a dict of named objects to prepare; they
    reach ``train_step`` and the optional hooks under the same names: ``sample(**parts)`` and
    ``validate(**parts)`` during training (``trainer.sample_every``, ``trainer.validate_every``;
    :mod:`litegen.trainer.hooks`), ``finish(**parts)`` once at the end.

    Example::

        run_entry(MainConfig.load_yaml("recipes/digits_dit.yaml"), "digits_dit.py", "recipes")
    """
    module = load_entry(entry, base_dir)
    hooks = {"sample_fn": _hook(module, "sample"), "validate_fn": _hook(module, "validate")}
    # Before the models load: bad input, a missing hook or logger package fails in seconds.
    check = _hook(module, "check_inputs")
    if check is not None:
        check(config)
    check_hooks(config, **hooks)
    check_loggers(config.trainer.loggers)
    gen = initialize(config)
    built = module.build(config)
    # Models, optimizers and datasets are prepared; anything else (an LR scheduler, a
    # held-out tuple, plain values) reaches train_step unchanged (litegen.entry.built_kind).
    names = parts_to_prepare(built, entry)
    prepared = gen.prepare(*(built[name] for name in names))
    parts = dict(built)
    parts.update(zip(names, prepared if len(names) > 1 else [prepared], strict=True))
    trainer = Trainer(
        gen,
        module.train_step,
        parts,
        run_info=_launch_info(gen, entry, base_dir),
        **hooks,
    )
    losses = trainer.fit()
    finish = _hook(module, "finish")
    if finish is not None:
        kwargs = {**parts, "gen": gen, "config": config, "step": trainer.step}
        finish(**keyword_filter(finish, skip_first=False)(kwargs))
    dist.barrier()
    return losses


def _hook(module: Any, name: str) -> Callable[..., Any] | None:
    hook = getattr(module, name, None)
    return hook if callable(hook) else None


def _launch_info(gen: LiteGen, entry: str, base_dir: str | Path | None) -> dict[str, Any]:
    """The `launch:` fields `litegen resume` needs to start this run again (from torchrun's env)."""
    info: dict[str, Any] = {
        "entry": entry,
        "nproc_per_node": gen.env.local_world_size,
        "nnodes": gen.env.nnodes,
    }
    if base_dir is not None:
        info["recipe_dir"] = str(Path(base_dir).absolute())
    if "TORCHELASTIC_MAX_RESTARTS" in os.environ:
        info["max_restarts"] = int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    return info


__all__ = ["run_entry"]
