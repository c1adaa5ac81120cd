"""The LiteGen object: ``initialize(config)`` makes it; ``prepare`` and checkpoints go through it.

gen = litegen.initialize(MainConfig.load_yaml("recipe.yaml"))
model, optimizer, loader = gen.prepare(model, optimizer, dataset)
...
gen.save_model(step=1000)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from litegen.config import MainConfig
from litegen.config.strategies import global_batch_problems
from litegen.data import prepare_data
from litegen.ema import EMA
from litegen.lora import apply_lora, has_adapters, train_adapters
from litegen.parallel import ParallelPlan, build_strategy
from litegen.runtime import distributed
from litegen.runtime.checkpointer import Checkpointer
from litegen.runtime.model_pipeline import ModelPipeline
from litegen.runtime.prepare_arguments import (
    PreparedModel,
    fqns_of,
    kind_of,
    owner_of,
    trained_models,
)
from litegen.runtime.prepared_models import PreparedModels
from litegen.runtime.weight_files import WeightFiles

log = logging.getLogger("litegen")


def _forward(holder: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """A LiteGen method that calls ``method`` on ``self.<holder>``, with its signature and
    docstring: LiteGen's public checkpoint methods are the checkpointer's."""
    held = attrgetter(holder)

    @functools.wraps(method)
    def call(self: LiteGen, *args: Any, **kwargs: Any) -> Any:
        return method(held(self), *args, **kwargs)

    return call


class LiteGen:
    """One training job's runtime: device, process group, prepared objects, and the
    checkpointer it holds (``gen.checkpointer``; its file methods are LiteGen's too).

    Example::

        gen = litegen.initialize(config)
        model, optimizer, loader = gen.prepare(model, optimizer, dataset)
    """

    def __init__(self, config: MainConfig) -> None:
        if not isinstance(config, MainConfig):
            raise TypeError(
                f"litegen.initialize needs a validated MainConfig, got {type(config).__name__}; "
                "load it with MainConfig.load_yaml(path) or MainConfig.from_dict(d) first."
            )
        self.config = config
        self.env = distributed.DistEnv.from_environ()
        self.device = distributed.resolve_device(config, self.env)
        distributed.init_process_group(config, self.env, self.device)
        distributed.set_tf32(config.optimization.precision.allow_tf32)
        # Same seed on every rank: models built before prepare are identical everywhere.
        distributed.seed_everything(config.global_seed)
        # Plans by (strategy, sp_size, cp_size), built once each: the job's here, a profile's
        # that names another strategy or layout at its first prepare.
        self._plans: dict[tuple[str, int, int], ParallelPlan] = {}
        self.plan = self._plan_for(config.optimization.parallel)
        batch = global_batch_problems(
            global_batch_size=config.global_batch_size,
            dp_size=self.plan.dp_size,
            grad_accum_steps=config.trainer.grad_accum_steps,
        )
        if batch:
            raise ValueError(f"{batch[0]}.")
        # Key prefix of adapter files: optimization.lora.prefix of the profile that applied it.
        lora = config.optimization.lora
        self.prepared = PreparedModels(
            lora_prefix=lora.prefix if lora is not None else "transformer"
        )
        self.checkpointer = Checkpointer(
            config, self.prepared, is_main_process=self.is_main_process
        )
        self._pipeline = ModelPipeline(self.device, self.is_main_process)

    # -- properties ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main_process(self) -> bool:
        return self.env.rank == 0

    @property
    def models(self) -> list[PreparedModel]:
        """The prepared models, in preparation order."""
        return self.prepared.models

    @property
    def ema(self) -> EMA | None:
        """The EMA of the first trainable model (``ema.enable``), once prepared."""
        return self.prepared.ema

    @ema.setter
    def ema(self, ema: EMA | None) -> None:
        self.prepared.ema = ema

    @property
    def lora_prefix(self) -> str:
        return self.prepared.lora_prefix

    @lora_prefix.setter
    def lora_prefix(self, prefix: str) -> None:
        self.prepared.lora_prefix = prefix

    # -- prepare ------------------------------------------------------------------------------
    def prepare(self, *objects: Any, profile: str | None = None) -> Any:
        """Hand native PyTorch objects to the runtime; get them back prepared, in order.

        Models, optimizers, datasets and DataLoaders are accepted; a dataset becomes a
        DataLoader over the global-batch sampler, a DataLoader keeps its own sampler (split
        between the ranks), an iterable dataset streams (docs/data.md). One argument returns
        one object. Models that no optimizer of the call steps (a VAE, a text encoder) come
        back frozen and unwrapped; :func:`litegen.runtime.prepare_arguments.trained_models` has the rule.

        Example::

            model, optimizer, vae, loader = gen.prepare(model, optimizer, vae, dataset)
        """
        kinds = [kind_of(obj, i) for i, obj in enumerate(objects)]
        optimization = self.config.optimization_for(profile)
        parallel_plan = self._plan_for(optimization.parallel)
        layout = (parallel_plan.sp_size, parallel_plan.cp_size)
        if layout != (self.plan.sp_size, self.plan.cp_size):
            raise ValueError(
                f"optimization profile {profile!r} sets parallel.sp_size x cp_size = "
                f"{layout[0]} x {layout[1]}, but the job's data loading was planned for "
                f"{self.plan.sp_size} x {self.plan.cp_size}; use one sp_size and one cp_size "
                "for every profile."
            )
        strategy = build_strategy(parallel_plan, optimization)
        results: list[Any] = list(objects)
        raw_models = [obj for obj, kind in zip(objects, kinds, strict=True) if kind == "model"]
        model_slots = [i for i, kind in enumerate(kinds) if kind == "model"]
        if raw_models and not self.models and self.config.init_from:
            self._load_into(raw_models[0], self.config.init_from, what="init_from")
        # Owners are found before wrapping: sharding strategies (fsdp2) replace the parameters
        # in place, so afterwards no model holds the optimizer's parameters any more.
        owners = {
            i: owner_of(obj, i, raw_models)
            for i, obj in enumerate(objects)
            if kinds[i] == "optimizer"
        }
        trained = trained_models(raw_models, owners.values())
        self._adapt(raw_models, trained, optimization)
        for i, owner in owners.items():
            if has_adapters(raw_models[owner]):
                train_adapters(objects[i], raw_models[owner])
        fqns = [fqns_of(m) for m in raw_models]  # after LoRA renamed the adapted weights
        lab = _open_lab(optimization)
        prepared: list[PreparedModel] = []
        for slot, model, train in zip(model_slots, raw_models, trained, strict=True):
            entry = self._pipeline.run(
                model,
                strategy,
                optimization,
                trained=train,
                lab=lab,
                ema_copy=train and strategy.ema_from_copy and self._ema_target_pending(),
            )
            prepared.append(entry)
            self.models.append(entry)
            results[slot] = entry.module
        for i, kind in enumerate(kinds):
            if kind == "optimizer":
                entry = prepared[owners[i]]
                results[i] = _wrap_optimizer(objects[i], entry, fqns[owners[i]], strategy, lab)
            elif kind in ("dataset", "dataloader"):
                results[i] = self._prepare_data(objects[i])
        if self.config.ema.enable and self.ema is None:
            trainable = [m for m in prepared if m.trainable]
            if trainable:
                self._build_ema(trainable[0])
        if self.config.resume_from and any(m.trainable for m in prepared):
            self._resume(self.config.resume_from)
        return results[0] if len(results) == 1 else results

    def _plan_for(self, parallel: Any) -> ParallelPlan:
        """The plan of a ``parallel`` section (the job's, or a profile's), built once."""
        key = (parallel.strategy, parallel.sp_size, parallel.cp_size)
        if key not in self._plans:
            self._plans[key] = ParallelPlan.build(
                parallel.strategy, parallel, self.env, self.device
            )
        return self._plans[key]

    def _adapt(self, raw_models: list[nn.Module], trained: list[bool], optimization) -> None:
        """``optimization.lora``: adapters on the job's first trainable model (litegen.lora).

        Before checkpointing, compile and the strategy's wrap, which must all see the adapter
        layers; after ``init_from``, whose keys are the base model's.
        """
        if optimization.lora is None or any(m.trainable for m in self.models):
            return
        target = next((m for m, t in zip(raw_models, trained, strict=True) if t), None)
        if target is not None:
            apply_lora(target, optimization.lora)
            self.lora_prefix = optimization.lora.prefix

    def _ema_target_pending(self) -> bool:
        """True while the model being prepared would be the one the EMA tracks."""
        return self.config.ema.enable and not any(m.trainable for m in self.models)

    def _build_ema(self, entry: PreparedModel) -> None:
        """EMA of the first trainable model, following its optimizer's master weights if any."""
        ema_cfg = self.config.ema
        optimizer = entry.optimizers[0] if entry.optimizers else None
        self.ema = entry.strategy.build_ema(
            entry.module, optimizer, sharded=ema_cfg.sharded, template=entry.ema_template
        )
        entry.ema_template = None
        if ema_cfg.resume_from:
            self.checkpointer.load_ema(entry, ema_cfg.resume_from)

    def _prepare_data(self, data: Any) -> Any:
        """A dataset or DataLoader becomes the job's loader (litegen/data/loader.py's table)."""
        return prepare_data(
            data, config=self.config, dp_rank=self.plan.dp_rank, dp_size=self.plan.dp_size
        )

    # -- checkpoints: the checkpointer's methods under LiteGen's names (same signatures, docs) ---
    save_model = _forward("checkpointer.files", WeightFiles.save_model)
    save_optimizer = _forward("checkpointer.files", WeightFiles.save_optimizer)
    save_ema = _forward("checkpointer.files", WeightFiles.save_ema)
    save_lora_peft = _forward("checkpointer.files", WeightFiles.save_lora_peft)
    save_diffusers = _forward("checkpointer.files", WeightFiles.save_diffusers)
    full_model_state = _forward("checkpointer.files", WeightFiles.full_model_state)
    full_ema_state = _forward("checkpointer.files", WeightFiles.full_ema_state)
    full_sampling_state = _forward("checkpointer.files", WeightFiles.full_sampling_state)
    save_model_state = _forward("checkpointer", Checkpointer.save_model_state)
    load_model_state = _forward("checkpointer", Checkpointer.load_model_state)
    dcp_state = _forward("checkpointer", Checkpointer.dcp_state)
    load = _forward("checkpointer", Checkpointer.load)

    # -- the checkpointer's loads that prepare calls -----------------------------------------
    def _load_into(self, model: nn.Module, path: str, *, what: str) -> None:
        self.checkpointer.load_init(model, path)

    def _resume(self, model_path: str) -> None:
        self.checkpointer.load_weights_and_optimizer(model_path)

    # -- lookups ------------------------------------------------------------------------------
    def _entry(self, model: nn.Module | None = None) -> PreparedModel:
        return self.prepared.entry(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper (for sampling, custom methods).

        An already unwrapped model comes back as it is, so hooks may unwrap what they receive.

        Example::

            images = gen.unwrap(model).generate(labels)
        """
        for entry in self.models:
            inner = entry.strategy.unwrap(entry.module)
            if model is entry.module or model is inner:
                return inner
        return self._entry(model).strategy.unwrap(model)  # raises, naming the fix

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Skip gradient communication for micro-batches that only accumulate."""
        return self._entry(model).strategy.no_sync(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm of a prepared model; returns the norm before clipping."""
        return self._entry(model).strategy.clip_grad_norm_(model, max_norm)

    def update_ema(self, decay: float | None = None) -> None:
        """Move the EMA towards the current weights (``ema.decay`` unless ``decay`` is given)."""
        if self.ema is None:
            raise ValueError("update_ema needs ema.enable: true and a prepared trainable model.")
        self.ema.update(self.config.ema.decay if decay is None else decay)

    def attention_context(self) -> AbstractContextManager:
        """The ``optimization.kernels.attention_backend`` context; the trainer enters it.

        Custom loops enter it around forward *and* backward (checkpointing recomputes there).

        Example::

            with gen.attention_context():
                loss = model(x).mean()
                loss.backward()
        """
        from litegen.kernels.attention import attention_context

        return attention_context(self.config.optimization.kernels.attention_backend, self.device)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """End the job: wait for every rank, then destroy all process groups.

        The groups' communication threads must be gone before the interpreter exits, or a
        rank can abort at shutdown. Call it once, after the last collective.

        Example::

            gen.save_model()
            gen.close()
        """
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _wrap_optimizer(
    optimizer: torch.optim.Optimizer,
    entry: PreparedModel,
    names: dict[int, str],
    strategy: Any,
    lab: Any,
) -> torch.optim.Optimizer:
    """``optimizer`` wrapped by ``strategy`` for the model of ``entry``, which keeps it and
    its parameters' names (``names``: parameter id -> name, taken before wrapping)."""
    entry.param_names.append(
        [[names.get(id(p), "?") for p in group["params"]] for group in optimizer.param_groups]
    )
    wrapped = strategy.wrap_optimizer(optimizer, entry.module, names)
    if lab is not None:
        lab.configure_optimizer(wrapped)
    entry.optimizers.append(wrapped)
    return wrapped


def _open_lab(optimization: Any) -> Any:
    """The experimental features the config switches on (``litegen.experimental``), or None.

    The one place the core reaches into the experimental area, and only when asked to.
    """
    from litegen.config import ExperimentalConfig

    if optimization.experimental == ExperimentalConfig():
        return None
    from litegen.experimental import Lab

    return Lab(optimization.experimental, optimization.compile.options)


def initialize(config: MainConfig) -> LiteGen:
    """Set up the process group, device and seeds for ``config``; returns the LiteGen object.

    Example::

        gen = litegen.initialize(MainConfig.load_yaml("recipe.yaml"))
    """
    return LiteGen(config)
