"""The checkpointer: one object, held by the runtime (``gen.checkpointer``) and the trainer,
that saves and loads every stateful part of a job.

Its collaborators are explicit: the config (file names and folders, the resume settings), the
job's :class:`~litegen.runtime.prepared_models.PreparedModels` (models, optimizers, EMA) and
whether this is the main process. The stateful parts, after torchtitan's ``CheckpointManager``:

- each trainable model with its optimizer and EMA (:meth:`Checkpointer.trainables`), sharded;
- the parts the training loop registers with :meth:`Checkpointer.start_run`: trainer state,
  LR schedulers, RNG and data position, this rank's own.

It holds the writer of full-weight files (``files``: :mod:`litegen.runtime.weight_files`).

Every resume setting goes through it: ``init_from`` (:meth:`Checkpointer.load_init`),
``resume_from`` (:meth:`Checkpointer.load_weights_and_optimizer`), ``ema.resume_from``
(:meth:`Checkpointer.load_ema`), and ``trainer.resume_run``, ``auto_resume`` and
``litegen resume --from`` (:meth:`Checkpointer.resume_source`, :meth:`Checkpointer.load_run`).

    gen.checkpointer.files.save_model(step=1000)   # <checkpoint_dir>/<exp_name>_step1000.pth
    gen.checkpointer.save_model_state("ckpt/1000", optimizer=optimizer, ema=True)  # sharded
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from litegen.checkpoint.atomic import replace_dir
from litegen.checkpoint.files import check_adapter_shapes, check_model_state
from litegen.checkpoint.interop import (
    is_plain_optimizer_state,
    load_model_source,
    named_optimizer_state,
    optimizer_file_for,
)
from litegen.checkpoint.layout import DCP_METADATA
from litegen.checkpoint.resume_rules import refuse_to_replace_newer, resume_source
from litegen.checkpoint.run_state import RunCheckpointer
from litegen.checkpoint.step_dirs import resolve_checkpoint
from litegen.checkpoint.trainable import Trainable
from litegen.config import MainConfig
from litegen.ema import persistent_buffers
from litegen.lora import has_adapters, is_adapter_file, model_keyed
from litegen.runtime.prepared_models import PreparedModels
from litegen.runtime.weight_files import WeightFiles

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from litegen.runtime.prepare_arguments import PreparedModel

log = logging.getLogger("litegen")


class Checkpointer:
    """Saves and loads the job's stateful parts: single files, DCP folders, run checkpoints.

    Call every method on every rank. ``LiteGen`` forwards its checkpoint methods here under the
    same names (``gen.load`` is ``gen.checkpointer.load``, ``gen.save_model`` is
    ``gen.checkpointer.files.save_model``).

    Example::

        checkpointer = Checkpointer(config, prepared, is_main_process=rank == 0)
        checkpointer.files.save_optimizer(step=1000, state_format="full")
    """

    def __init__(
        self, config: MainConfig, prepared: PreparedModels, *, is_main_process: bool
    ) -> None:
        self.config = config
        self.prepared = prepared
        self.is_main_process = is_main_process
        self.files = WeightFiles(config, prepared, is_main_process=is_main_process)
        self.run: RunCheckpointer | None = None  # made by start_run

    # -- run checkpoints ----------------------------------------------------------------------
    def start_run(self, parts: Mapping[str, Stateful]) -> RunCheckpointer:
        """Open the run checkpoints of ``checkpoint_dir`` over the trainables and ``parts``.

        ``parts`` are this rank's stateful parts (name -> ``state_dict``/``load_state_dict``);
        the entries of their state dicts make up ``trainer/rank_<r>.pt``.

        Example::

            gen.checkpointer.start_run({"trainer": train_state, "rng": rng_state})
        """
        self.run = RunCheckpointer(
            self.trainables,
            self.config.get_checkpoint_dir(),
            parts=parts,
            keep_last=self.config.trainer.keep_last,
            async_save=self.config.trainer.async_checkpoint,
        )
        return self.run

    def states(self) -> dict[str, Stateful]:
        """Every stateful part by name: ``model_<i>`` (model, optimizer, EMA) and the run's."""
        models = {f"model_{i}": trainable for i, trainable in enumerate(self.trainables())}
        return {**models, **(self.run.parts if self.run is not None else {})}

    def resume_source(self) -> Path | None:
        """The run checkpoint a training run continues from, the same on every rank (or None):
        :func:`litegen.checkpoint.resume_rules.resume_source` (``trainer.resume_run``, which
        ``litegen resume --from`` sets, ``auto_resume`` and torchrun restarts)."""
        return resume_source(self.config)

    def load_run(self, path: str | Path) -> Path:
        """Load a run checkpoint into every stateful part; returns the ``step_<N>`` folder.

        A folder whose newer steps this run would overwrite is refused first.

        Example::

            gen.checkpointer.load_run("results/dit")  # the latest complete step in it
        """
        if self.run is None:
            raise ValueError("load_run needs the run's stateful parts: call start_run first.")
        path = resolve_checkpoint(path)
        refuse_to_replace_newer(path, self.config.get_checkpoint_dir())
        self.run.load(path)
        return path

    # -- DCP folders and loads ----------------------------------------------------------------
    def dcp_state(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        ema: bool | None = None,
    ) -> dict[str, Any]:
        """The state dict torch.distributed.checkpoint saves and loads in place (sharded)."""
        return self._trainable(model, optimizer, ema).dcp_state()

    def save_model_state(
        self,
        path: str | Path,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        ema: bool | None = None,
    ) -> Path:
        """Save sharded model/optimizer/EMA state with torch.distributed.checkpoint (a folder).

        It reshards on load, so a run saved on 4 ranks loads on 2. The folder is written under
        a temporary name and renamed into place once every rank is done. Call on every rank.

        Example::

            gen.save_model_state("ckpt/step1000", optimizer=optimizer, ema=True)
        """
        import torch.distributed.checkpoint as dcp

        state = self.dcp_state(model, optimizer, ema)
        target = Path(path)
        name = [f".{target.name}.partial-{uuid.uuid4().hex[:8]}"]
        dist.broadcast_object_list(name, src=0)  # one temporary folder for every rank
        partial = target.with_name(name[0])
        dcp.save(state, checkpoint_id=str(partial))
        dist.barrier()
        if self.is_main_process:
            replace_dir(partial, target)
        dist.barrier()
        return target

    def load_model_state(
        self,
        path: str | Path,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        ema: bool | None = None,
    ) -> None:
        """Load what :meth:`save_model_state` wrote, resharding to this job's layout."""
        if not Path(path, DCP_METADATA).is_file():
            raise FileNotFoundError(
                f"{path} is not a complete distributed checkpoint (no .metadata file); "
                "point to a folder written by gen.save_model_state."
            )
        self._trainable(model, optimizer, ema).load(path)

    def _trainable(self, model, optimizer, ema) -> Trainable:
        entry = self.prepared.entry(model)
        return Trainable(
            entry.module, optimizer, entry.strategy, self.prepared.ema if ema else None
        )

    def load(self, model: nn.Module, path: str | Path) -> None:
        """Load full model weights into a prepared model: a file (.pth, .pt, .bin, .safetensors;
        LiteGen's or a plain ``torch.save(model.state_dict())``) or a diffusers
        ``save_pretrained`` folder. A model with LoRA adapters also takes an adapter file
        written by :meth:`save_model`."""
        entry = self.prepared.entry(model)
        state = load_model_source(path, what="model")
        if has_adapters(entry.module) and is_adapter_file(state):
            module = entry.strategy.unwrap(entry.module)
            adapters = model_keyed(module, state, self.prepared.lora_prefix, path)
            # An adapter file of another rank has the right keys at other shapes.
            check_adapter_shapes(entry.strategy.dcp_state(entry.module)["model"], adapters, path)
            entry.strategy.load_full_model_state(entry.module, adapters, strict=False)
            return
        # The strategy's sharded state has every key at its global shape; the unwrapped module's
        # own state_dict() does not under FSDP1 (flat shards, and it breaks FSDP1's lazy init).
        check_model_state(entry.strategy.dcp_state(entry.module)["model"], state, path)
        entry.strategy.load_full_model_state(entry.module, state)

    def load_init(self, model: nn.Module, path: str) -> None:
        """``init_from``: full weights into a model not yet prepared (the base model's keys)."""
        state = load_model_source(path, what="init_from")
        check_model_state(model.state_dict(), state, path)
        model.load_state_dict(state)

    def load_ema(self, entry: PreparedModel, path: str) -> None:
        """Full EMA weights (``ema.resume_from``), keyed like the unwrapped model."""
        state = load_model_source(path, what="ema.resume_from")
        model = entry.strategy.unwrap(entry.module)
        expected = {**dict(model.named_parameters()), **dict(persistent_buffers(model))}
        if has_adapters(model) and is_adapter_file(state):
            adapters = model_keyed(model, state, self.prepared.lora_prefix, path)
            check_adapter_shapes(expected, adapters, path)
            self.prepared.ema.load_state_dict(adapters)
            return
        check_model_state(expected, state, path)
        self.prepared.ema.load_state_dict(state)

    def trainables(self) -> list[Trainable]:
        """What a run checkpoint holds: each trainable model with its optimizer; the EMA goes
        with the first one.

        Example::

            RunCheckpointer(gen.checkpointer.trainables, "results/dit").save(1000, files)
        """
        found = []
        for i, entry in enumerate(self.prepared.trainable()):
            if len(entry.optimizers) > 1:
                raise ValueError(
                    "run checkpoints hold one optimizer per trainable model; this model has "
                    f"{len(entry.optimizers)}. Use one optimizer with several param groups."
                )
            optimizer = entry.optimizers[0] if entry.optimizers else None
            ema = self.prepared.ema if i == 0 else None
            found.append(Trainable(entry.module, optimizer, entry.strategy, ema))
        return found

    def load_weights_and_optimizer(self, model_path: str) -> None:
        """``resume_from``: the model's weights, then its optimizer's state found beside them
        (LiteGen's files, plain PyTorch state dicts or a diffusers folder: checkpoint/interop.py)."""
        from litegen.checkpoint.zero_state import load_optimizer_state

        entry = self.prepared.entry()
        self.load(entry.module, model_path)
        if not entry.optimizers:
            return
        path = optimizer_file_for(model_path)
        state = load_optimizer_state(path)
        if is_plain_optimizer_state(state):
            shapes = entry.strategy.dcp_state(entry.module)["model"]
            state = named_optimizer_state(state, entry.param_names[0], shapes, path)
        entry.strategy.load_full_optimizer_state(entry.optimizers[0], entry.module, state)
