"""The LiteGen object: ``initialize(config)`` makes it; ``prepare`` and checkpoints go through it.

gen = litegen.initialize(MainConfig.load_yaml("recipe.yaml"))
model, optimizer, loader = gen.prepare(model, optimizer, dataset)
...
gen.save_model(step=1000)
"""

from __future__ import annotations

import copy
import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from litegen.checkpoint.api import CheckpointAPI
from litegen.config import MainConfig
from litegen.data import prepare_data
from litegen.ema import EMA
from litegen.fp8_training import apply_fp8_training
from litegen.fp8_weights import store_frozen_linears_in_fp8
from litegen.lora import apply_lora, has_adapters, train_adapters
from litegen.memory import BlockSwap, apply_memory_optimizations
from litegen.parallel import ParallelPlan, build_strategy
from litegen.precision import cast_model
from litegen.runtime import distributed
from litegen.runtime.prepare import (
    PreparedModel,
    fqns_of,
    kind_of,
    owner_of,
    trained_models,
)

log = logging.getLogger("litegen")


class LiteGen(CheckpointAPI):
    """One training job's runtime: device, process group, prepared objects, checkpoints.

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
        self.plan = ParallelPlan.build(
            config.optimization.parallel.strategy,
            config.optimization.parallel,
            self.env,
            self.device,
        )
        dp = self.plan.dp_size
        if config.global_batch_size % dp:
            raise ValueError(
                f"global_batch_size={config.global_batch_size} must be a multiple of the "
                f"data-parallel size {dp}; pick a multiple of {dp}."
            )
        self.models: list[PreparedModel] = []
        self.ema: EMA | None = None
        self._sp_group: dist.ProcessGroup | None = None  # made at the first sp_size > 1 prepare
        self._warned_inert = False  # activation checkpointing of no block, said once
        # Key prefix of adapter files: optimization.lora.prefix of the profile that applied it.
        lora = config.optimization.lora
        self.lora_prefix = lora.prefix if lora is not None else "transformer"

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

    # -- prepare ------------------------------------------------------------------------------
    def prepare(self, *objects: Any, profile: str | None = None) -> Any:
        """Hand native PyTorch objects to the runtime; get them back prepared, in order.

        Models, optimizers, datasets and DataLoaders are accepted; a dataset becomes a
        DataLoader over the global-batch sampler, a DataLoader keeps its own sampler (split
        between the ranks), an iterable dataset streams (docs/data.md). One argument returns
        one object. Models that no optimizer of the call steps (a VAE, a text encoder) come
        back frozen and unwrapped; :func:`litegen.runtime.prepare.trained_models` has the rule.

        Example::

            model, optimizer, vae, loader = gen.prepare(model, optimizer, vae, dataset)
        """
        kinds = [kind_of(obj, i) for i, obj in enumerate(objects)]
        optimization = self.config.optimization_for(profile)
        plan = ParallelPlan.build(
            optimization.parallel.strategy, optimization.parallel, self.env, self.device
        )
        if plan.sp_size != self.plan.sp_size:
            raise ValueError(
                f"optimization profile {profile!r} sets parallel.sp_size={plan.sp_size}, but the "
                f"job's data loading was planned for sp_size={self.plan.sp_size}; use one "
                "sp_size for every profile."
            )
        strategy = build_strategy(plan, optimization)
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
            entry = self._prepare_model(model, train, strategy, optimization, lab)
            prepared.append(entry)
            self.models.append(entry)
            results[slot] = entry.module
        for i, kind in enumerate(kinds):
            if kind == "optimizer":
                owner = owners[i]
                entry = prepared[owner]
                names = fqns[owner]
                groups = objects[i].param_groups
                entry.param_names.append(
                    [[names.get(id(p), "?") for p in g["params"]] for g in groups]
                )
                results[i] = strategy.wrap_optimizer(objects[i], entry.module, fqns[owner])
                if lab is not None:
                    lab.configure_optimizer(results[i])
                entry.optimizers.append(results[i])
            elif kind in ("dataset", "dataloader"):
                results[i] = self._prepare_data(objects[i])
        if self.config.ema.enable and self.ema is None:
            trainable = [m for m in prepared if m.trainable]
            if trainable:
                self._build_ema(trainable[0])
        if self.config.resume_from and any(m.trainable for m in prepared):
            self._resume(self.config.resume_from)
        return results[0] if len(results) == 1 else results

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
            self._load_ema(entry, ema_cfg.resume_from)

    def _prepare_model(
        self, model: nn.Module, trained: bool, strategy, optimization, lab
    ) -> PreparedModel:
        precision = optimization.precision
        if precision.cast_model:
            cast_model(model, precision.cast_model, precision.cast_exclude_paths)
        if optimization.kernels.fused_layernorm:
            from litegen.kernels import apply_fused_layernorm

            apply_fused_layernorm(model)
        if lab is not None:
            lab.swap_modules(model)
        if trained:
            lora = optimization.lora
            if lora is not None and lora.fp8_base is not None and has_adapters(model):
                # After cast_model (the layers dequantise to the cast dtype), before the wrap
                # moves the model to the device.
                stored = store_frozen_linears_in_fp8(model, lora.fp8_base)
                log.info("%s: %d frozen Linear weights in fp8", type(model).__name__, len(stored))
            if precision.fp8_linear is not None:  # after fp8_base: its layers are not nn.Linear
                converted = apply_fp8_training(model, precision.fp8_linear, self.device)
                log.info("%s: %d Linear layers train in fp8", type(model).__name__, converted)
            template = None
            if strategy.ema_from_copy and self._ema_target_pending():
                # Taken before checkpointing and compile touch the blocks: the EMA copy only
                # holds weights and never runs forward.
                template = copy.deepcopy(model)
            if strategy.plan.sp_size > 1:
                self._apply_sequence_parallel(model, strategy.plan)
            # Block swap patches the blocks' forward first, so that checkpointing wraps it and
            # its recompute fetches the weights again (litegen/memory/block_swap.py).
            swap = None
            if optimization.memory.block_swap is not None:
                swap = BlockSwap(
                    model, optimization.memory.block_swap.blocks_on_device, self.device
                )
            # Checkpointing patches blocks in place before the strategy wraps (or shards) them.
            memory = apply_memory_optimizations(
                model,
                optimization.memory,
                candidates=strategy.checkpoint_candidates(model),
                device=self.device,
            )
            self._warn_inert_checkpointing(model, optimization, memory)
            # policy memory_budget without compile was refused with the config (config/checks).
            if memory.candidates or memory.memory_budget is not None or memory.chunked_mlps:
                log.info("%s: %s", type(model).__name__, memory.describe())
            if optimization.compile.enabled:
                # After checkpointing (compiled inside each block's BlockForward) and before the
                # wrap, so FSDP's hooks stay outside the compiled regions (litegen/compile.py).
                from litegen.compile import compile_blocks

                compiled = compile_blocks(
                    model,
                    optimization.compile,
                    memory_budget=memory.memory_budget,
                    block_contexts=self._compiled_block_contexts(strategy, lab),
                )
                log.info("%s: compiled %d block(s)", type(model).__name__, len(compiled))
            wrapped = strategy.wrap_model(model)
            if swap is not None:  # the model is on the device once, wrapped; now move out
                swap.to_host()
                memory.block_swap = swap
                log.info(
                    "%s: block swap: frozen weights of %d of %d blocks in host memory",
                    type(model).__name__,
                    len(swap.swapped),
                    len(swap.blocks),
                )
            return PreparedModel(
                wrapped, strategy, trainable=True, ema_template=template, memory=memory
            )
        return PreparedModel(strategy.wrap_frozen_model(model), strategy, trainable=False)

    def _warn_inert_checkpointing(self, model: nn.Module, optimization, memory) -> None:
        """Once per job, on rank 0: checkpointing is on and checkpoints no block (the config's
        own warning said so when it loaded; this names the model and its block count)."""
        inert = optimization.memory.activation_checkpoint.checkpoints_nothing()
        if inert is None or not memory.candidates or self._warned_inert:
            return
        self._warned_inert = True
        if self.is_main_process:
            log.warning(
                "%s: activation checkpointing of 0 of %d blocks. %s",
                type(model).__name__,
                len(memory.candidates),
                inert,
            )

    def _apply_sequence_parallel(self, model: nn.Module, plan: ParallelPlan) -> None:
        """Install the model's sequence-parallel plan, before checkpointing, compile and wrap.

        Its split and gather are hooks on module calls, which run outside the blocks' patched
        ``forward`` (checkpoint, compile): a checkpointed block saves only its shard of the
        sequence, and the collectives at the block boundaries stay out of compiled graphs. Its
        attention wrappers sit inside the blocks, where recomputation and compile see them.
        The plan names the user's module paths, before a wrapper renames them.
        """
        from litegen.parallel.mesh import sp_mesh
        from litegen.parallel.sequence import apply_sequence_parallel, plan_for

        if self._sp_group is None:
            self._sp_group = sp_mesh(plan).get_group("sp")
        apply_sequence_parallel(model, plan_for(model), self._sp_group)
        log.info(
            "%s: sequence parallel over %d ranks (data parallel over %d groups)",
            type(model).__name__,
            plan.sp_size,
            plan.dp_size,
        )

    @staticmethod
    def _compiled_block_contexts(strategy, lab) -> list[Any]:
        """What each compiled block enters around its calls (``compile_blocks``)."""
        contexts = []
        if strategy.plan.sp_size > 1:
            from litegen.parallel.sequence import compile_context

            contexts.append(compile_context)
        if lab is not None and (rows := lab.block_context()) is not None:
            contexts.append(rows)
        return contexts

    def _prepare_data(self, data: Any) -> Any:
        """A dataset or DataLoader becomes the job's loader (litegen/data/loader.py's table)."""
        return prepare_data(
            data, config=self.config, dp_rank=self.plan.dp_rank, dp_size=self.plan.dp_size
        )

    # -- lookups ------------------------------------------------------------------------------
    def _entry(self, model: nn.Module | None = None) -> PreparedModel:
        if model is None:
            trainable = [m for m in self.models if m.trainable]
            if not trainable:
                raise ValueError("no trainable model has been prepared yet; call prepare first.")
            return trainable[0]
        for entry in self.models:
            if entry.module is model:
                return entry
        raise ValueError("this model was not returned by gen.prepare; pass the prepared model.")

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
