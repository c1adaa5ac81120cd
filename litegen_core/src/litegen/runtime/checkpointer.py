"""The checkpointer: one object, held by the runtime (``gen.checkpointer``) and the trainer,
that saves and loads every stateful part of a job.

Its collaborators are explicit: the config (file names and folders, the resume settings), the
job's :class:`~litegen.runtime.prepared_models.PreparedModels` (models, optimizers, EMA) and
whether this is the main process. The stateful parts, after torchtitan's ``CheckpointManager``:

- each trainable model with its optimizer and EMA (:meth:`Checkpointer.trainables`), sharded;
- the parts the training loop registers with :meth:`Checkpointer.start_run`: trainer state,
  LR schedulers, RNG and data position, this rank's own.

Every resume setting goes through it: ``init_from`` (:meth:`Checkpointer.load_init`),
``resume_from`` (:meth:`Checkpointer.load_weights_and_optimizer`), ``ema.resume_from``
(:meth:`Checkpointer.load_ema`), and ``trainer.resume_run``, ``auto_resume`` and
``litegen resume --from`` (:meth:`Checkpointer.resume_source`, :meth:`Checkpointer.load_run`).

    gen.checkpointer.save_model(step=1000)         # <checkpoint_dir>/<exp_name>_step1000.pth
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
from litegen.checkpoint.files import (
    check_adapter_shapes,
    check_model_state,
    checkpoint_path,
    save_state,
)
from litegen.checkpoint.interop import (
    is_plain_optimizer_state,
    load_model_source,
    named_optimizer_state,
    optimizer_file_for,
    write_diffusers_folder,
)
from litegen.checkpoint.layout import DCP_METADATA, DIFFUSERS_DIR, check_file_name
from litegen.checkpoint.resume_rules import refuse_to_replace_newer, resume_source
from litegen.checkpoint.run_state import RunCheckpointer
from litegen.checkpoint.step_dirs import resolve_checkpoint
from litegen.checkpoint.trainable import Trainable
from litegen.config import MainConfig
from litegen.ema import persistent_buffers
from litegen.lora import (
    adapter_file_state,
    has_adapters,
    is_adapter_file,
    model_keyed,
    save_peft_folder,
)
from litegen.runtime.prepared_models import PreparedModels

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from litegen.runtime.prepare import PreparedModel

log = logging.getLogger("litegen")


class Checkpointer:
    """Saves and loads the job's stateful parts: single files, DCP folders, run checkpoints.

    Call every method on every rank. ``LiteGen`` exposes the file methods under the same names
    (``gen.save_model`` is ``gen.checkpointer.save_model``).

    Example::

        checkpointer = Checkpointer(config, prepared, is_main_process=rank == 0)
        checkpointer.save_optimizer(step=1000, state_format="full")
    """

    def __init__(
        self, config: MainConfig, prepared: PreparedModels, *, is_main_process: bool
    ) -> None:
        self.config = config
        self.prepared = prepared
        self.is_main_process = is_main_process
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

    def save_weights(self, step: int | None = None) -> None:
        """Model, optimizer and (when enabled) EMA files, named by the spec's rules."""
        self.save_model(step=step)
        self.save_optimizer(step=step)
        if self.prepared.ema is not None:
            self.save_ema(step=step)

    # -- single files and DCP folders ---------------------------------------------------------
    def _path(self, kind: str, output_folder, filename, step) -> Path:
        return checkpoint_path(
            kind,
            default_folder=self.config.get_checkpoint_dir(),
            exp_name=self.config.exp_name,
            output_folder=output_folder,
            filename=filename,
            step=step,
        )

    def _write(self, state: dict, path: Path, metadata: dict[str, str] | None = None) -> Path:
        if self.is_main_process:
            save_state(state, path, metadata)
            log.info("saved %s", path)
        dist.barrier()
        return path

    def _write_adapters(self, entry: PreparedModel, state: dict, path: Path) -> Path:
        """Write the LoRA adapters of ``state`` (full values) in diffusers' layout."""
        module = entry.strategy.unwrap(entry.module)
        tensors, metadata = adapter_file_state(module, state, self.prepared.lora_prefix)
        return self._write(tensors, path, metadata)

    def save_model(
        self,
        output_folder: str | None = None,
        filename: str | None = None,
        step: int | None = None,
        model: nn.Module | None = None,
    ) -> Path:
        """Gather the full model state; rank 0 writes one file. Call on every rank.

        A model with LoRA adapters (``optimization.lora`` or the user's peft model) writes the
        adapters alone, in diffusers' layout: ``<exp_name>.lora.safetensors`` by default.

        Example::

            gen.save_model(step=1000)  # <checkpoint_dir>/<exp_name>_step1000.pth
        """
        entry = self.prepared.entry(model)
        if has_adapters(entry.module):
            state = entry.strategy.full_model_state(entry.module, trainable_only=True)
            path = self._path("lora", output_folder, filename, step)
            return self._write_adapters(entry, state, path)
        state = self.full_model_state(model)
        return self._write(state, self._path("model", output_folder, filename, step))

    def full_model_state(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The whole state of a prepared model (default: the first trainable one) on CPU.

        Gathered from every rank's shard, so call it on every rank.

        Example::

            sampler_model.load_state_dict(gen.full_model_state(model))
        """
        entry = self.prepared.entry(model)
        return entry.strategy.full_model_state(entry.module)

    def save_optimizer(
        self,
        output_folder: str | None = None,
        filename: str | None = None,
        step: int | None = None,
        state_format: str = "auto",
        model: nn.Module | None = None,
    ) -> Path:
        """Write the optimizer state of the (first trainable) model. Call on every rank.

        ``state_format="full"`` always writes one consolidated file; ``"auto"`` lets a
        sharding strategy write rank-local shards plus a manifest instead.
        """
        if state_format not in ("auto", "full"):
            raise ValueError(f"state_format must be 'auto' or 'full', got {state_format!r}.")
        entry = self.prepared.entry(model)
        if not entry.optimizers:
            raise ValueError("save_optimizer: no optimizer was prepared with this model.")
        path = self._path("optimizer", output_folder, filename, step)
        entry.strategy.save_optimizer_file(entry.optimizers[0], entry.module, path, state_format)
        if self.is_main_process:
            log.info("saved %s", path)
        return path

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

    def save_ema(
        self, output_folder: str | None = None, filename: str | None = None, step: int | None = None
    ) -> Path:
        """Write the EMA weights as one full file (the adapters alone for a LoRA model, as
        ``<exp_name>.ema.lora.safetensors``). Call on every rank."""
        entry = self.prepared.entry()
        if self.prepared.ema is not None and has_adapters(entry.module):
            path = self._path("ema_lora", output_folder, filename, step)
            return self._write_adapters(entry, self.prepared.ema.state_dict(), path)
        return self._write(self.full_ema_state(), self._path("ema", output_folder, filename, step))

    def save_lora_peft(
        self,
        output_folder: str | Path | None = None,
        *,
        ema: bool = False,
        model: nn.Module | None = None,
    ) -> Path:
        """Write the LoRA adapters (the EMA's with ``ema=True``) as a peft folder:
        ``adapter_config.json`` and ``adapter_model.safetensors``. Call on every rank.

        The default folder is ``<checkpoint_dir>/<exp_name>.peft`` (``.ema.peft``).

        Example::

            folder = gen.save_lora_peft()
            PeftModel.from_pretrained(base_model, folder)  # the trained model's outputs
        """
        entry = self.prepared.entry(model)
        if not has_adapters(entry.module):
            raise ValueError(
                "save_lora_peft writes LoRA adapters, and this model has none; set "
                "optimization.lora, or write the whole model with save_model or save_diffusers."
            )
        if ema and self.prepared.ema is None:
            raise ValueError("save_lora_peft(ema=True) needs ema.enable: true.")
        if ema:
            state = self.prepared.ema.state_dict()
        else:
            state = entry.strategy.full_model_state(entry.module, trainable_only=True)
        name = f"{check_file_name(self.config.exp_name, 'exp_name')}{'.ema' if ema else ''}.peft"
        folder = Path(output_folder or Path(self.config.get_checkpoint_dir()) / name)
        if self.is_main_process:
            save_peft_folder(entry.strategy.unwrap(entry.module), state, folder)
            log.info("saved %s", folder)
        dist.barrier()
        return folder

    def full_ema_state(self) -> dict[str, torch.Tensor]:
        """The whole EMA model state on CPU, keyed like the model. Call on every rank.

        The EMA averages the trainable parameters; frozen ones (a LoRA model's base) come from
        the model. Raises ``ValueError`` without an EMA; ``full_sampling_state`` falls back to
        the model.

        Example::

            sampler_model.load_state_dict(gen.full_ema_state())
        """
        if self.prepared.ema is None:
            raise ValueError("the EMA needs ema.enable: true and a prepared trainable model.")
        averaged = self.prepared.ema.state_dict()
        entry = self.prepared.entry()
        frozen = [p for p in entry.module.parameters() if not p.requires_grad]
        if not frozen:
            return averaged
        return {**entry.strategy.full_model_state(entry.module), **averaged}

    def full_sampling_state(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The weights to sample with: the EMA's when ``ema.enable``, else the model's.

        Example::

            sampler_model.load_state_dict(gen.full_sampling_state())  # every rank calls it
        """
        return (
            self.full_ema_state() if self.prepared.ema is not None else self.full_model_state(model)
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

    def save_diffusers(
        self,
        output_folder: str | Path | None = None,
        ema: bool | None = None,
        model: nn.Module | None = None,
    ) -> Path:
        """Write the trained model as a diffusers folder that ``from_pretrained`` loads.

        The full weights are gathered from every rank (so call it on every rank), the EMA's
        when ``ema`` (default: when ``ema.enable``), and rank 0 writes them through the model's
        own ``save_pretrained`` (a model without one gets safetensors and its config) into
        ``output_folder``, by default ``<results_dir>/diffusers``; the folder is written under a
        temporary name and renamed into place.

        Example::

            gen.save_diffusers()  # then DiTTransformer2DModel.from_pretrained(folder)
        """
        entry = self.prepared.entry(model)
        if has_adapters(entry.module):
            raise ValueError(
                "save_diffusers writes whole models; a LoRA model's adapter files "
                "(save_model, save_ema) are already in diffusers' layout (load_lora_weights)."
            )
        use_ema = self.prepared.ema is not None if ema is None else ema
        if use_ema and (
            self.prepared.ema is None or model not in (None, self.prepared.entry().module)
        ):
            raise ValueError(
                "save_diffusers(ema=True) needs ema.enable: true and the first trainable model; "
                "pass ema=False to export the model's own weights."
            )
        state = self.full_ema_state() if use_ema else self.full_model_state(model)
        folder = Path(output_folder or Path(self.config.get_results_dir()) / DIFFUSERS_DIR)
        if self.is_main_process:
            partial = folder.with_name(f".{folder.name}.partial-{uuid.uuid4().hex[:8]}")
            write_diffusers_folder(entry.strategy.unwrap(entry.module), state, partial)
            replace_dir(partial, folder)
            log.info("saved %s (%s weights)", folder, "EMA" if use_ema else "model")
        dist.barrier()
        return folder
