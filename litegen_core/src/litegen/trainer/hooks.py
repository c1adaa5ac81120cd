"""The entry module's optional ``sample`` and ``validate`` hooks, run every N training steps.

Both run under ``torch.no_grad()`` with the trained models in eval mode, and neither changes
training: the global RNG states are captured before and restored after, train mode comes back,
and ``sample`` sees the EMA weights (when ``ema.enable``) only for its duration, the model's
own weights being copied back bit for bit.

- ``sample(**parts)`` runs on every rank when the model is sharded or split over sequence
  ranks (its forward is collective); otherwise (ddp, zero1, zero2) on rank 0 alone, with the
  trainable models unwrapped (a DDP wrapper's forward would wait for the other ranks), while
  the other ranks go on to the next step. It receives, by keyword,
  whichever of the prepared parts, ``gen``, ``config``, ``step`` and ``out_dir``
  (``<results_dir>/samples/step_<N>/``) it asks for. What it returns (images ``(N, C, H, W)``
  or videos ``(N, C, T, H, W)``, values in [0, 1] or [-1, 1]) is saved by rank 0 as a PNG or
  GIF grid (:func:`litegen.trainer.sample_files.save_samples`); it may also write PNG or GIF files
  into ``out_dir`` itself (on rank 0). The loggers get every PNG and GIF there.
- ``validate(**parts)`` runs on every rank (each on its part of a held-out set) with the
  model's own weights and returns a loss; the mean over ranks is logged as ``val_loss``.

Example:
    >>> def sample(model, gen, out_dir):
    ...     return gen.unwrap(model).generate(torch.arange(8))  # (8, 3, 32, 32) in [-1, 1]
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from litegen.checkpoint.layout import SAMPLES_DIR
from litegen.checkpoint.rng import capture_rng, restore_rng
from litegen.runtime.litegen import LiteGen
from litegen.trainer.sample_files import MEDIA_SUFFIXES, save_samples


def keyword_filter(
    fn: Callable[..., Any], *, skip_first: bool = True
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Keep the keyword arguments ``fn`` accepts (all of them if it takes ``**kwargs``).

    Example:
        >>> keyword_filter(lambda batch, model: 0)({"model": 1, "gen": 2})
        {'model': 1}
    """
    params = list(inspect.signature(fn).parameters.values())
    params = params[1:] if skip_first else params  # train_step's first argument is the batch
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return lambda kwargs: kwargs
    names = {p.name for p in params}
    return lambda kwargs: {k: v for k, v in kwargs.items() if k in names}


def check_hooks(
    config: Any,
    *,
    sample_fn: Callable[..., Any] | None,
    validate_fn: Callable[..., Any] | None,
) -> None:
    """Raise ``ValueError`` when ``trainer.sample_every`` or ``validate_every`` is set but the
    hook it calls is missing; :func:`run_entry` checks before building anything."""
    for field, fn, name in (
        ("sample_every", sample_fn, "sample"),
        ("validate_every", validate_fn, "validate"),
    ):
        every = getattr(config.trainer, field)
        if every and fn is None:
            raise ValueError(
                f"trainer.{field} is {every} but there is no {name}() hook: define "
                f"{name}(**parts) in the entry module (or pass {name}_fn= to Trainer), or set "
                f"trainer.{field}: 0."
            )


class TrainingHooks:
    """Calls ``sample_fn`` and ``validate_fn`` at their steps (``trainer.sample_every``,
    ``trainer.validate_every``); see the module docstring for what they receive.

    Example::

        hooks = TrainingHooks(gen, parts, sample_fn=sample)
        hooks.run(step=100)  # {'val_loss': ..., 'media': [...]} as far as due
    """

    def __init__(
        self,
        gen: LiteGen,
        parts: dict[str, Any],
        *,
        sample_fn: Callable[..., Any] | None = None,
        validate_fn: Callable[..., Any] | None = None,
    ) -> None:
        cfg = gen.config.trainer
        check_hooks(gen.config, sample_fn=sample_fn, validate_fn=validate_fn)
        self.gen = gen
        self.parts = {**parts, "gen": gen, "config": gen.config}
        self.sample_fn, self.validate_fn = sample_fn, validate_fn
        self.sample_every, self.validate_every = cfg.sample_every, cfg.validate_every
        self.samples_dir = Path(gen.config.get_results_dir()) / SAMPLES_DIR
        self.models = [m.module for m in gen.models if m.trainable]
        # Whole models on every rank (ddp, zero1, zero2): one rank can sample alone.
        sharded = gen.plan.seq_size > 1 or any(
            m.strategy.shards_parameters for m in gen.models if m.trainable
        )
        self._sample_here = sharded or gen.is_main_process
        # Rank 0 samples alone: it gets the user's modules, since a wrapper's forward (DDP's
        # buffer broadcast) would wait for the other ranks.
        self._sample_parts = self.parts
        if not sharded:
            unwrapped = {id(m): gen.unwrap(m) for m in self.models}
            self._sample_parts = {k: unwrapped.get(id(v), v) for k, v in self.parts.items()}

    def due(self, step: int) -> bool:
        """Whether a hook runs after ``step`` (never at step 0)."""
        if not (self.sample_every or self.validate_every) or step == 0:
            return False  # the common case, at every step: two attribute reads
        return any(
            every and step % every == 0 for every in (self.sample_every, self.validate_every)
        )

    def run(self, step: int) -> dict[str, Any]:
        """Run the hooks due after ``step``; returns ``val_loss`` and ``media`` (files) if any."""
        out: dict[str, Any] = {}
        if self.validate_every and step % self.validate_every == 0:
            with self._isolated():
                out["val_loss"] = self._validate(step)
        if self.sample_every and step % self.sample_every == 0:
            with self._isolated():
                media = self._sample(step)
            if media:
                out["media"] = media
        return out

    @contextlib.contextmanager
    def _isolated(self) -> Iterator[None]:
        """No grad, eval mode, and the RNG states and train modes as they were afterwards."""
        rng = capture_rng(self.gen.device)
        modes = [(m, m.training) for model in self.models for m in model.modules()]
        try:
            with torch.no_grad():
                for model in self.models:
                    model.eval()
                yield
        finally:
            for module, training in modes:
                module.training = training
            restore_rng(rng, self.gen.device)

    @staticmethod
    def _call(fn: Callable[..., Any], parts: dict[str, Any], **extra: Any) -> Any:
        return fn(**keyword_filter(fn, skip_first=False)({**parts, **extra}))

    def _validate(self, step: int) -> float:
        loss = self._call(self.validate_fn, self.parts, step=step)
        if not isinstance(loss, torch.Tensor | float | int) or (
            isinstance(loss, torch.Tensor) and loss.numel() != 1
        ):
            raise ValueError(
                f"validate() must return the validation loss as a float or a scalar tensor, "
                f"got {type(loss).__name__}."
            )
        value = torch.as_tensor(loss, dtype=torch.float32).detach().reshape(1).to(self.gen.device)
        if self.gen.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        return float(value.item())

    def _sample(self, step: int) -> list[Path]:
        out_dir = self.samples_dir / f"step_{step}"
        if self.gen.is_main_process:
            out_dir.mkdir(parents=True, exist_ok=True)
        returned = None
        with ema_weights(self.gen):
            if self._sample_here:
                returned = self._call(
                    self.sample_fn, self._sample_parts, step=step, out_dir=out_dir
                )
        if not self.gen.is_main_process:
            return []
        if returned is not None:
            save_samples(returned, out_dir)
        return sorted(p for p in out_dir.iterdir() if p.suffix.lower() in MEDIA_SUFFIXES)


@contextlib.contextmanager
def ema_weights(gen: LiteGen) -> Iterator[None]:
    """The first trainable model holds the EMA weights inside the block (when ``ema.enable``;
    otherwise nothing changes); its own weights and buffers come back bit for bit after.

    The EMA is gathered like ``save_ema`` gathers it and loaded through the strategy, so every
    rank takes part, whatever the EMA's layout.

    Example::

        with ema_weights(gen):
            images = gen.unwrap(model).generate(labels)
    """
    if gen.ema is None:
        yield
        return
    entry = next(m for m in gen.models if m.trainable)
    module = entry.module
    with torch.no_grad():
        # At rest first: after a forward (a validate hook's) fsdp2 shows gathered copies in
        # place of the shards, which are what it gathers from and what is saved here.
        entry.strategy.reshard(module)
        own = [(t, t.detach().clone()) for t in [*module.parameters(), *module.buffers()]]
        entry.strategy.load_full_model_state(module, gen.ema.state_dict(), strict=False)
    try:
        yield
    finally:
        with torch.no_grad():
            # Drop the EMA's gathered copies: fsdp1 would otherwise train its root unit on them.
            entry.strategy.reshard(module)
            for tensor, saved in own:
                tensor.detach().copy_(saved)


__all__ = ["TrainingHooks", "check_hooks", "ema_weights", "keyword_filter"]
