"""The training loop that ``litegen launch`` runs around a user's ``train_step``.

Library users can run it too::

    gen = litegen.initialize(config)
    parts = dict(zip(("model", "optimizer", "loader"), gen.prepare(model, optimizer, dataset)))
    Trainer(gen, train_step, parts).fit()

``train_step(batch, **parts)`` returns the loss of one micro-batch. It receives, by keyword,
whichever of the prepared parts, ``gen``, ``config`` and ``step`` its signature asks for (or all
of them through ``**kwargs``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DataLoader

from litegen.checkpoint.run_state import RunCheckpointer, capture_rng, find_latest, restore_rng
from litegen.config import MainConfig
from litegen.data import data_state, load_data_state, to_device
from litegen.entry import load_entry
from litegen.flops import StepThroughput
from litegen.loss_guard import LossGuard
from litegen.metrics import MetricsLogger
from litegen.readback import Readback
from litegen.runtime.litegen import LiteGen, initialize
from litegen.runtime.prepare import preparable_kind

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

    Example:
        >>> Trainer(gen, train_step, {"model": model, "optimizer": opt, "loader": loader}).fit()
    """

    def __init__(
        self,
        gen: LiteGen,
        train_step: Callable[..., torch.Tensor],
        parts: dict[str, Any],
        run_info: dict[str, Any] | None = None,
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
        self.step = getattr(self.loader.batch_sampler, "start_step", 0)
        # What train_step receives, chosen once: only ``step`` changes from call to call.
        accepted = _keyword_filter(train_step)
        self._step_kwargs = accepted({**parts, "gen": gen, "config": self.config})
        self._wants_step = "step" in accepted({"step": None})
        self._autocast = _AUTOCAST.get(self.config.trainer.autocast)
        # Entered every step; where the backend's context does nothing (auto off CUDA), a
        # shared no-op takes its place.
        no_op = isinstance(gen.attention_context(), contextlib.nullcontext)
        self._attention = contextlib.nullcontext if no_op else gen.attention_context
        self.loss_guard = LossGuard(gen.device)
        # Run checkpoints (checkpoint/run_state.py); run_info becomes launch.yaml in each one.
        self.run_info = dict(run_info or {})
        self.checkpointer = RunCheckpointer(
            gen.trainables,
            self.config.get_checkpoint_dir(),
            keep_last=self.config.trainer.keep_last,
            async_save=self.config.trainer.async_checkpoint,
        )
        self._resume_checked = False
        self._restore_after_iter: dict[str, Any] | None = None
        # tokens/s and MFU in the logs (litegen/flops.py); FLOPs are counted on the first step.
        self.throughput = StepThroughput(
            gen.unwrap(self.models[0]) if self.models else None,
            device=gen.device,
            world_size=gen.world_size,
            samples_per_step=self.config.global_batch_size,
            accum=self.config.trainer.grad_accum_steps,
            peak_tflops=self.config.trainer.peak_tflops,
            tokens_per_sample=self.config.trainer.tokens_per_sample,
        )

    # -- one optimizer step -------------------------------------------------------------------
    def _micro_step(self, batch: Any, *, last: bool, accum: int) -> torch.Tensor:
        kwargs = self._step_kwargs
        if self._wants_step:
            kwargs = {**kwargs, "step": self.step}
        with self._micro_contexts(last):
            try:
                loss = self.train_step(batch, **kwargs)
            except RuntimeError as exc:
                hint = _cast_model_hint(self.config, exc)
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
        contexts = [self.throughput.count()] if self.throughput.counting else []
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
        if self._restore_after_iter is not None:
            # Creating the iterator draws a worker seed from the RNG; the saved states are
            # those after that draw in the original run, so they go back only now.
            self._restore_rng(self._restore_after_iter)
            self._restore_after_iter = None
        with MetricsLogger(
            self.config.get_results_dir(),
            total_steps=self.config.max_steps,
            enabled=self.gen.is_main_process,
            start_step=self.step,
        ) as metrics:
            # Logged values reach the host behind the step's kernels and are written once they
            # have arrived (litegen/readback.py): a logged step makes the host wait for nothing.
            pending = Readback(self.gen.device)
            window = (pending.start_time, self.step)  # the time and step of the last record
            try:
                while self.step < self.config.max_steps:
                    result = self.run_step(batches)
                    logged = self.step % cfg.log_every == 0 or self.step == self.config.max_steps
                    if result.finite and logged:
                        self._queue_record(pending, result)
                    metrics.advance(self.step)
                    window = self._write_records(pending, metrics, window, losses, wait=False)
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        self.save_run_checkpoint()
                self._write_records(pending, metrics, window, losses, wait=True)
            except BaseException:
                # The records queued before the failure (a non-finite loss, say) are still
                # written, unless the device itself failed.
                with contextlib.suppress(Exception):
                    self._write_records(pending, metrics, window, losses, wait=True)
                raise
        self.loss_guard.raise_if_nonfinite()  # the last steps' deferred checks
        self.checkpointer.wait()  # an asynchronous save is complete before the run ends
        if cfg.save_final:
            self.save_checkpoint(step=None)
        if cfg.export_diffusers:
            self.gen.save_diffusers(ema=cfg.export_ema and self.gen.ema is not None)
        return losses

    def _queue_record(self, pending: Readback, result: StepResult) -> None:
        """Queue a logged step's mean loss (over ranks) and gradient norm for the host."""
        loss = result.loss
        if self.gen.world_size > 1:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        values = loss.reshape(1)
        if result.grad_norm is not None:
            values = torch.stack([loss.reshape(()), result.grad_norm.reshape(())])
        pending.push(values, (self.step, self.optimizers[0].param_groups[0]["lr"]))

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
        finished each logged step (no host sync: litegen/readback.py).
        """
        for (step, lr), device_values, when in pending.ready(wait=wait):
            mean_loss, *grad_norm = device_values
            losses.append(mean_loss)
            values = {"loss": mean_loss}
            values.update(self.throughput.metrics(step - window[1], when - window[0]))
            values["lr"] = lr
            if grad_norm:
                values["grad_norm"] = grad_norm[0]
            metrics.log(step, when=when, **values)
            window = (when, step)
        return window

    # -- run checkpoints and resume -----------------------------------------------------------
    def resume_source(self) -> Path | None:
        """The run checkpoint :meth:`fit` continues from, the same on every rank (or None).

        After a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) and with ``auto_resume``
        it is the latest complete one in ``checkpoint_dir``; otherwise ``trainer.resume_run``.
        """
        self._resume_checked = True
        choice: list[str | None] = [None]
        if self.gen.is_main_process:
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0
            explicit = self.config.trainer.resume_run
            if restarted or (self.config.auto_resume and not explicit):
                latest = find_latest(self.config.get_checkpoint_dir())
                choice[0] = str(latest) if latest else None
            if choice[0] is None and explicit:
                choice[0] = explicit
        # Rank 0 decides: ranks reading the folder at slightly different times must agree.
        dist.broadcast_object_list(choice, src=0)
        return Path(choice[0]) if choice[0] else None

    def resume(self, path: str | Path) -> None:
        """Continue from a run checkpoint: weights, optimizer, EMA, step, data position, RNG.

        Example:
            >>> trainer.resume("results/dit/step_1000"); trainer.fit()
        """
        self._resume_checked = True
        state = self.checkpointer.load(path)
        if len(state["schedulers"]) != len(self.schedulers):
            raise ValueError(
                f"run checkpoint {path} holds {len(state['schedulers'])} LR scheduler(s), this "
                f"run has {len(self.schedulers)}; build the same schedulers to resume."
            )
        for scheduler, scheduler_state in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(scheduler_state)
        self.step = int(state["step"])
        # The data position (litegen/data/state.py); older checkpoints hold none.
        load_data_state(self.loader, state.get("data"), self.step)
        self._restore_after_iter = state
        log.info("resumed from %s at step %d", path, self.step)

    def _rank_state(self) -> dict[str, Any]:
        """This rank's part of a run checkpoint (the model side goes through DCP)."""
        generator = self.loader.generator
        return {
            "step": self.step,
            "schedulers": [scheduler.state_dict() for scheduler in self.schedulers],
            "rng": capture_rng(self.gen.device),
            "loader_generator": generator.get_state() if generator is not None else None,
            "data": data_state(self.loader, self.step),
        }

    def _restore_rng(self, state: dict[str, Any]) -> None:
        restore_rng(state["rng"], self.gen.device)
        if self.loader.generator is not None and state.get("loader_generator") is not None:
            self.loader.generator.set_state(state["loader_generator"])

    def save_run_checkpoint(self) -> None:
        """Write ``<checkpoint_dir>/step_<step>/`` (see checkpoint/run_state.py). Every rank."""
        # Absolute paths: `litegen resume` from any folder continues in the same folders.
        files = {"config.yaml": self.config.with_absolute_paths().to_yaml()}
        if self.run_info:
            files["launch.yaml"] = yaml.safe_dump(self.run_info, sort_keys=False)
        self.checkpointer.save(self.step, self._rank_state(), files)

    def save_checkpoint(self, step: int | None) -> None:
        """Model, optimizer and (when enabled) EMA files, named by the spec's rules."""
        self.gen.save_model(step=step)
        self.gen.save_optimizer(step=step)
        if self.gen.ema is not None:
            self.gen.save_ema(step=step)


@contextlib.contextmanager
def _all_of(contexts: list[contextlib.AbstractContextManager]) -> Iterator[None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _cast_model_hint(config: MainConfig, exc: RuntimeError) -> str | None:
    """The fix for a dtype mismatch that ``cast_model`` without autocast causes, if it may be one.

    ``cast_model`` casts the parameters, not the batch, so FP32 inputs reach bf16 weights; torch
    then names the two dtypes but not the setting behind them. Only torch's plain
    ``RuntimeError`` naming both FP32 and the cast dtype gets the hint, re-raised with it.
    """
    cast = config.optimization.precision.cast_model
    if type(exc) is not RuntimeError or cast in (None, "fp32") or config.trainer.autocast:
        return None
    names = {"bf16": ("BFloat16", "bfloat16"), "fp16": ("Half", "float16")}[cast]
    message = str(exc)
    fp32 = re.search(r"\b[Ff]loat(?!16)", message)  # Float, float, FloatTensor; not BFloat16
    if not (fp32 and any(name in message for name in names)):
        return None
    return (
        f"optimization.precision.cast_model is {cast}: it casts the model's parameters, not the "
        f"batch. Set trainer.autocast: {cast}, which casts FP32 inputs in the forward, or cast "
        "the inputs in train_step."
    )


def _keyword_filter(
    fn: Callable[..., Any], *, skip_first: bool = True
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Keep the keyword arguments ``fn`` accepts (all of them if it takes ``**kwargs``)."""
    params = list(inspect.signature(fn).parameters.values())
    params = params[1:] if skip_first else params  # train_step's first argument is the batch
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return lambda kwargs: kwargs
    names = {p.name for p in params}
    return lambda kwargs: {k: v for k, v in kwargs.items() if k in names}


def run_entry(config: MainConfig, entry: str, base_dir: str | Path | None = None) -> list[float]:
    """Everything ``litegen launch`` does inside one worker: build, prepare, train, finish.

    The entry module's ``build(config)`` returns a dict of named objects to prepare; they
    reach ``train_step`` (and an optional ``finish(**parts)`` hook) under the same names.

    Example:
        >>> run_entry(MainConfig.load_yaml("recipes/digits_dit.yaml"), "digits_dit.py", "recipes")
    """
    module = load_entry(entry, base_dir)
    gen = initialize(config)
    built = module.build(config)
    if not isinstance(built, dict) or not built:
        raise ValueError(
            f"build(config) in entry module '{entry}' must return a non-empty dict of named "
            f"objects to prepare (model, optimizer, dataset, ...), got {type(built).__name__}."
        )
    # Models, optimizers and datasets are prepared; anything else (an LR scheduler, a
    # tokenizer, plain values) reaches train_step unchanged.
    names = [name for name, obj in built.items() if preparable_kind(obj) is not None]
    prepared = gen.prepare(*(built[name] for name in names))
    parts = dict(built)
    parts.update(zip(names, prepared if len(names) > 1 else [prepared], strict=True))
    trainer = Trainer(gen, module.train_step, parts, run_info=_launch_info(gen, entry, base_dir))
    losses = trainer.fit()
    finish = getattr(module, "finish", None)
    if callable(finish):
        kwargs = {**parts, "gen": gen, "config": config, "step": trainer.step}
        finish(**_keyword_filter(finish, skip_first=False)(kwargs))
    dist.barrier()
    return losses


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


__all__ = ["Trainer", "run_entry"]
