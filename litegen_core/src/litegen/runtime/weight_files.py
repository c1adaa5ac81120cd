"""Full-weight files and folders of the prepared models: what ``gen.save_model``, ``save_ema``,
``save_optimizer``, ``save_lora_peft`` and ``save_diffusers`` write, and the full states they
gather. The checkpointer holds one (``gen.checkpointer.files``).

Example::

    gen.checkpointer.files.save_model(step=1000)  # <checkpoint_dir>/<exp_name>_step1000.pth
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from litegen.checkpoint.atomic import replace_dir
from litegen.checkpoint.files import checkpoint_path, save_state
from litegen.checkpoint.interop import write_diffusers_folder
from litegen.checkpoint.layout import DIFFUSERS_DIR, check_file_name
from litegen.config import MainConfig
from litegen.lora import adapter_file_state, has_adapters, save_peft_folder
from litegen.runtime.prepared_models import PreparedModels

if TYPE_CHECKING:
    from litegen.runtime.prepare_arguments import PreparedModel

log = logging.getLogger("litegen")


class WeightFiles:
    """Writes the full weights of the prepared models (and their optimizers, EMA) as single
    files or folders, named by the spec's rules; gathers full states. Call on every rank.

    Example::

        files = WeightFiles(config, prepared, is_main_process=rank == 0)
        files.save_optimizer(step=1000, state_format="full")
    """

    def __init__(
        self, config: MainConfig, prepared: PreparedModels, *, is_main_process: bool
    ) -> None:
        self.config = config
        self.prepared = prepared
        self.is_main_process = is_main_process

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

    def save_weights(self, step: int | None = None) -> None:
        """Model, optimizer and (when enabled) EMA files, named by the spec's rules."""
        self.save_model(step=step)
        self.save_optimizer(step=step)
        if self.prepared.ema is not None:
            self.save_ema(step=step)

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

    def full_model_state(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The whole state of a prepared model (default: the first trainable one) on CPU.

        Gathered from every rank's shard, so call it on every rank.

        Example::

            sampler_model.load_state_dict(gen.full_model_state(model))
        """
        entry = self.prepared.entry(model)
        return entry.strategy.full_model_state(entry.module)

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
