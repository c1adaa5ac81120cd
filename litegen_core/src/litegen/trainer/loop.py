"""The training loop: steps, accumulation, clipping, EMA, logged records, run checkpoints.

Example::

    Trainer(gen, train_step, {"model": model, "optimizer": opt, "loader": loader}).fit()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DataLoader

from litegen.checkpoint.layout import CONFIG, LAUNCH
from litegen.checkpoint.save_checks import last_good_note
from litegen.checkpoint.step_dirs import read_config_text
from litegen.data import to_device
from litegen.flops.throughput import StepThroughput
from litegen.instruments.loss_guard import LossGuard
from litegen.instruments.metrics import MetricsLogger
from litegen.instruments.readback import Readback
from litegen.loggers import check_loggers
from litegen.memory.stats import peak_memory_since_last_call
from litegen.runtime.litegen import LiteGen
from litegen.trainer.checkpoints import (
    DataPosition,
    RngState,
    Schedulers,
    TrainState,
    apply_changed_optimizer_settings,
)
from litegen.trainer.hints import cast_model_hint
from litegen.trainer.hooks import TrainingHooks, keyword_filter
from litegen.trainer.profiling import StepProfiler

log = logging.getLogger("litegen")

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    """One optimizer step's mean micro-batch loss and gradient norm, still on the device."""

    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    finite: bool


class Trainer:
    """Backward, accumulation, clipping, optimizer and scheduler steps, EMA, logs, checkpoints.

    Run checkpoints go through the runtime's checkpointer (``gen.checkpointer``), which the
    trainer holds too and gives its stateful parts: trainer state, schedulers, RNG, data
    position (litegen/trainer/checkpoints.py).

    ``sample_fn`` and ``validate_fn`` are the optional hooks of :mod:`litegen.trainer.hooks`,
    called every ``trainer.sample_every`` and ``trainer.validate_every`` steps.

    Example::

        Trainer(gen, train_step, {"model": model, "optimizer": opt, "loader": loader}).fit()
    """

    def __init__(
        self,
        gen: LiteGen,
        train_step: Callable[..., torch.Tensor],
        parts: dict[str, Any],
        run_info: dict[str, Any] | None = None,
        *,
        sample_fn: Callable[..., Any] | None = None,
        validate_fn: Callable[..., Any] | None = None,
    ) -> None:
        self.gen = gen
        self.config = gen.config
        self.train_step = train_step
        self.parts = parts
        loaders = [v for v in parts.values() if isinstance(v, DataLoader)]
        if len(loaders) != 1:
            raise ValueError(
                f"the training loop needs exactly one dataset or DataLoader among the prepared "
                f"parts, got {len(loaders)}; return one dataset from build(config)."
            )
        self.loader = loaders[0]
        self.optimizers = [v for v in parts.values() if isinstance(v, torch.optim.Optimizer)]
        if not self.optimizers:
            raise ValueError("the training loop needs an optimizer; return one from build(config).")
        self.schedulers = [
            v for v in parts.values() if isinstance(v, torch.optim.lr_scheduler.LRScheduler)
        ]
        self.models = [m.module for m in gen.models if m.trainable]
        self.state = TrainState(getattr(self.loader.batch_sampler, "start_step", 0))
        # What train_step receives, chosen once: only ``step`` changes from call to call.
        accepted = keyword_filter(train_step)
        self._step_kwargs = accepted({**parts, "gen": gen, "config": self.config})
        self._wants_step = "step" in accepted({"step": None})
        self._autocast = _AUTOCAST.get(self.config.trainer.autocast)
        # Entered every step; where the backend's context does nothing (auto off CUDA), a
        # shared no-op takes its place.
        no_op = isinstance(gen.attention_context(), contextlib.nullcontext)
        self._attention = contextlib.nullcontext if no_op else gen.attention_context
        # Run checkpoints: the runtime's checkpointer over the models and these parts (in the
        # order of trainer/rank_<r>.pt's keys); run_info becomes launch.yaml in each one.
        self.run_info = dict(run_info or {})
        self.checkpointer = gen.checkpointer
        self.rng = RngState(self.loader, gen.device)
        self.run_checkpoints = self.checkpointer.start_run(
            {
                "trainer": self.state,
                "schedulers": Schedulers(self.schedulers),
                "rng": self.rng,
                "data": DataPosition(self.loader, lambda: self.step),
            }
        )
        # An abort names the last good checkpoint.
        self.loss_guard = LossGuard(
            gen.device, note=lambda: last_good_note(self.run_checkpoints.last_good())
        )
        self._resume_checked = False
        # tokens/s and MFU in the logs (litegen/flops/throughput.py); FLOPs are counted on the first training step.
        self.throughput = StepThroughput(
            gen.unwrap(self.models[0]) if self.models else None,
            device=gen.device,
            world_size=gen.world_size,
            samples_per_step=self.config.global_batch_size,
            accum=self.config.trainer.grad_accum_steps,
            peak_tflops=self.config.trainer.peak_tflops,
            tokens_per_sample=self.config.trainer.tokens_per_sample,
        )
        # Checked on every rank before training starts: a missing hook or logger package fails
        # now, not at the first sample or on rank 0 alone.
        self.hooks = TrainingHooks(gen, parts, sample_fn=sample_fn, validate_fn=validate_fn)
        check_loggers(self.config.trainer.loggers)
        profile = self.config.trainer.profile
        self.profiler = (
            StepProfiler(profile, Path(self.config.get_results_dir()), gen.device, gen.rank)
            if profile is not None
            else None
        )

    @property
    def step(self) -> int:
        """Optimizer steps taken (the trainer state a run checkpoint holds)."""
        return self.state.step

    @step.setter
    def step(self, step: int) -> None:
        self.state.step = step

    # -- run checkpoints ----------------------------------------------------------------------
    def resume_source(self) -> Path | None:
        """The run checkpoint :meth:`fit` continues from (or None): ``trainer.resume_run``,
        ``auto_resume`` or a torchrun restart (:meth:`Checkpointer.resume_source`)."""
        self._resume_checked = True
        return self.checkpointer.resume_source()

    def resume(self, path: str | Path) -> None:
        """Continue from a run checkpoint: weights, optimizer, EMA, step, data position, RNG.

        Example::

            trainer.resume("results/dit/step_1000"); trainer.fit()
        """
        self._resume_checked = True
        path = self.checkpointer.load_run(path)
        saved = read_config_text(path)
        apply_changed_optimizer_settings(saved, self.config, self.optimizers, self.schedulers)
        log.info("resumed from %s at step %d", path, self.step)

    def save_run_checkpoint(self) -> None:
        """Write ``<checkpoint_dir>/step_<step>/`` (layout: checkpoint/layout.py). Every rank.

        The deferred loss checks of the steps up to this one come first: no checkpoint of a
        step whose loss was not finite is ever written.
        """
        self.loss_guard.raise_if_nonfinite()
        # Absolute paths: `litegen resume` from any folder continues in the same folders.
        files = {CONFIG: self.config.with_absolute_paths().to_yaml()}
        if self.run_info:
            files[LAUNCH] = yaml.safe_dump(self.run_info, sort_keys=False)
        self.run_checkpoints.save(self.step, files)

    # -- one optimizer step -------------------------------------------------------------------
    def _micro_step(self, batch: Any, *, last: bool, accum: int) -> torch.Tensor:
        kwargs = self._step_kwargs
        if self._wants_step:
            # The number of the optimizer step this micro-batch belongs to, counted from 1: the
            # step its loss is logged under and a checkpoint after it is named for.
            kwargs = {**kwargs, "step": self.step + 1}
        with self._micro_contexts(last):
            try:
                loss = self.train_step(batch, **kwargs)
            except RuntimeError as exc:
                hint = cast_model_hint(self.config, exc)
                if hint is None:
                    raise
                raise RuntimeError(f"{exc}\n{hint}") from exc
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    f"train_step must return the loss as a scalar tensor, got {type(loss).__name__}"
                    f"{f' of shape {tuple(loss.shape)}' if isinstance(loss, torch.Tensor) else ''}."
                )
            (loss / accum if accum > 1 else loss).backward()
        return loss.detach().float()

    def _micro_contexts(self, last: bool) -> contextlib.AbstractContextManager:
        """FLOP counting (first step), ``no_sync`` (all but the last micro-batch), autocast."""
        # The auto planner's first step runs extra forwards: counting waits for a training step.
        counting = self.throughput.counting and not any(
            entry.memory is not None and entry.memory.measuring for entry in self.gen.models
        )
        contexts = [self.throughput.count()] if counting else []
        if not last:
            contexts += [self.gen.no_sync(model) for model in self.models]
        if self._autocast is not None:
            contexts.append(torch.autocast(self.gen.device.type, dtype=self._autocast))
        if len(contexts) < 2:  # the common case: no stack to build
            return contexts[0] if contexts else contextlib.nullcontext()
        return _all_of(contexts)

    def _optimizer_step(self) -> torch.Tensor | None:
        """Clip, step, schedule, EMA; returns the gradient norm (on the device) when clipping."""
        grad_norm = None
        max_norm = self.config.trainer.max_grad_norm
        if max_norm is not None:
            norms = [self.gen.clip_grad_norm_(model, max_norm) for model in self.models]
            grad_norm = torch.stack([n.detach().float().reshape(()) for n in norms]).norm()
        for optimizer in self.optimizers:
            optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()
        if self.gen.ema is not None:
            self.gen.update_ema()
        return grad_norm

    def run_step(self, batches) -> StepResult:
        """One optimizer step: the micro-batches, the non-finite check, the update.

        A skipped step (``on_nan: skip``) still consumed its batches, and the step counter (the
        sampler's cursor) advances either way, so logs, checkpoints and resume stay aligned.
        """
        accum = self.config.trainer.grad_accum_steps
        loss_sum = None
        # Around backward too: checkpointed blocks recompute their attention there.
        with self._attention():
            for micro in range(accum):
                batch = to_device(next(batches), self.gen.device)
                loss = self._micro_step(batch, last=micro == accum - 1, accum=accum)
                loss_sum = loss if loss_sum is None else loss_sum + loss
        finite, grad_norm = True, None
        if self.config.trainer.on_nan == "skip":
            finite = self.loss_guard.finite_now(loss_sum)
            if finite:
                grad_norm = self._optimizer_step()
            else:
                log.warning(
                    "the loss is not finite at step %d on at least one rank; skipping this "
                    "step (trainer.on_nan: skip).",
                    self.step + 1,
                )
        else:
            self.loss_guard.defer(loss_sum, self.step + 1)
            grad_norm = self._optimizer_step()
        self._zero_grad()
        self.step += 1
        return StepResult(loss_sum / accum if accum > 1 else loss_sum, grad_norm, finite)

    def _zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> list[float]:
        """Train from the current step to ``max_steps``; returns the logged mean losses.

        It first continues from a run checkpoint when ``trainer.resume_run``, ``auto_resume`` or
        a torchrun restart asks for one (see :meth:`resume_source`).
        """
        if not self._resume_checked:
            source = self.resume_source()
            if source is not None:
                self.resume(source)
        cfg = self.config.trainer
        for model in self.models:
            model.train()
        losses: list[float] = []
        batches = iter(self.loader)
        # Creating the iterator draws a worker seed from the RNG; a resumed run's saved states
        # are those after that draw in the original run, so they go back only now.
        self.rng.restore()
        with self._metrics_logger() as metrics:
            # Logged values reach the host behind the step's kernels and are written once they
            # have arrived (instruments/readback.py): a logged step makes the host wait for nothing.
            pending = Readback(self.gen.device)
            window = (pending.start_time, self.step)  # the time and step of the last record
            try:
                while self.step < self.config.max_steps:
                    if self.profiler is not None:
                        self.profiler.before_step(self.step + 1)
                    result = self.run_step(batches)
                    if self.profiler is not None:
                        self.profiler.after_step(self.step)
                    # A hook's step is logged (val_loss, sample files), on every rank alike:
                    # queuing a record is a collective.
                    hooked = self.hooks.due(self.step)
                    extras = self.hooks.run(self.step) if hooked else {}
                    logged = self.step % cfg.log_every == 0 or self.step == self.config.max_steps
                    if (result.finite and logged) or hooked:
                        self._queue_record(pending, result, extras)
                    metrics.advance(self.step)
                    window = self._write_records(pending, metrics, window, losses, wait=False)
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        self.save_run_checkpoint()
                self._write_records(pending, metrics, window, losses, wait=True)
                self.loss_guard.raise_if_nonfinite()  # the last steps' deferred checks
            except BaseException:
                # The records queued before the failure (a non-finite loss, say) are still
                # written, unless the device itself failed; so is the last checkpoint every
                # rank wrote (the error names it as the last good one).
                with contextlib.suppress(Exception):
                    self._write_records(pending, metrics, window, losses, wait=True)
                with contextlib.suppress(Exception):
                    self.run_checkpoints.finish_after_failure()
                raise
        self.run_checkpoints.wait()  # an asynchronous save is complete before the run ends
        if cfg.save_final:
            self.checkpointer.files.save_weights()
        if cfg.export_diffusers:
            self.gen.save_diffusers(ema=cfg.export_ema and self.gen.ema is not None)
        return losses

    def _metrics_logger(self) -> MetricsLogger:
        cfg = self.config.trainer
        return MetricsLogger(
            self.config.get_results_dir(),
            total_steps=self.config.max_steps,
            enabled=self.gen.is_main_process,
            start_step=self.step,
            loggers=cfg.loggers,
            run_name=self.config.exp_name,
            wandb=cfg.wandb,
            run_config=self.config.model_dump(mode="json") if "wandb" in cfg.loggers else None,
        )

    def _queue_record(
        self, pending: Readback, result: StepResult, extras: dict[str, Any] | None = None
    ) -> None:
        """Queue a logged step's mean loss (over ranks) and gradient norm for the host.

        ``extras`` (the hooks' ``val_loss`` and sample files) and the peak memory since the
        last record (host-side allocator counters: no device sync) travel with it.
        """
        loss = result.loss
        if self.gen.world_size > 1:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        values = loss.reshape(1)
        if result.grad_norm is not None:
            values = torch.stack([loss.reshape(()), result.grad_norm.reshape(())])
        host = {**peak_memory_since_last_call(self.gen.device), **(extras or {})}
        pending.push(values, (self.step, self.optimizers[0].param_groups[0]["lr"], host))

    def _write_records(
        self,
        pending: Readback,
        metrics: MetricsLogger,
        window: tuple[float, int],
        losses: list[float],
        *,
        wait: bool,
    ) -> tuple[float, int]:
        """Write the queued records that have arrived; returns the last one's (time, step).

        Throughput is over the steps since the previous record, timed by when the device
        finished each logged step (no host sync: instruments/readback.py).
        """
        for (step, lr, host), device_values, when in pending.ready(wait=wait):
            mean_loss, *grad_norm = device_values
            losses.append(mean_loss)
            values = {"loss": mean_loss}
            values.update(self.throughput.metrics(step - window[1], when - window[0]))
            values["lr"] = lr
            if grad_norm:
                values["grad_norm"] = grad_norm[0]
            media = host.pop("media", ())
            values.update(host)
            metrics.log(step, when=when, media=media, **values)
            window = (when, step)
        return window


@contextlib.contextmanager
def _all_of(contexts: list[contextlib.AbstractContextManager]) -> Iterator[None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


__all__ = ["StepResult", "Trainer"]
