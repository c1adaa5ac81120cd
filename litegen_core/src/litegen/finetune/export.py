"""Exports of a fine-tuned diffusers pipeline, from a run in memory or from a run checkpoint.

A run that trains the transformer of a pipeline folder (``finetune.pipeline``) exports either

* the whole pipeline folder with the trained transformer (full fine-tuning), which
  ``DiffusionPipeline.from_pretrained`` loads. Its frozen components (text encoders, VAE,
  tokenizers, scheduler) are symbolic links to the source folder's, never copies; with
  ``original=True`` the transformer is also written as one safetensors file in the original
  model's key layout, ``<name>.original.safetensors`` (ComfyUI's diffusion-model loader,
  ``from_single_file``), or
* its LoRA adapters (a LoRA run): ``<name>.lora.safetensors`` in diffusers' layout, which
  ``pipe.load_lora_weights`` loads, the peft folder ``<name>.peft``, which
  ``PeftModel.from_pretrained`` loads, and, for a transformer whose original layout LiteGen
  knows (:mod:`litegen.model_keys.original_format`), ``<name>.original.lora.safetensors`` in
  that layout with alpha kept, which ComfyUI's LoRA loaders and ``pipe.load_lora_weights``
  read.

:func:`write_export` writes either from the transformer and its full weights; the end of a run
calls it with the gathered weights, and :func:`export_checkpoint` (``litegen export``) with the
weights of a ``step_<N>`` run checkpoint, read in one process without the ranks that saved it.
Every file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from litegen.checkpoint.files import check_model_state, replace_dir, save_state
from litegen.checkpoint.interop import write_diffusers_folder
from litegen.checkpoint.step_dirs import read_config_text, read_metadata, resolve_checkpoint
from litegen.families import KeyMap, key_map_for, original_format_classes
from litegen.finetune.experts import EXPERTS, pipeline_boundary
from litegen.lora import adapter_alpha_state, adapter_file_state, has_adapters, save_peft_folder
from litegen.model_keys.original_format import lora_to_original, output_rows, weights_to_original
from litegen.model_parts.paths import clean_name
from litegen.pretrained import check_pipeline_folder, load_component

log = logging.getLogger("litegen")

TRAINED = "transformer"  # the pipeline component the fine-tuning recipes train
ORIGINAL_LORA_SUFFIX = ".original.lora.safetensors"
ORIGINAL_WEIGHTS_SUFFIX = ".original.safetensors"


def write_export(
    transformer: nn.Module,
    state: Mapping[str, torch.Tensor],
    pipeline: str | Path,
    out: str | Path,
    *,
    name: str,
    lora_prefix: str = TRAINED,
    original: bool = False,
) -> Path:
    """Write the export of ``transformer`` with the full weights ``state`` into ``out``.

    With LoRA adapters on ``transformer``: ``out/<name>.lora.safetensors``, ``out/<name>.peft``
    and, where the transformer's original layout is known, ``out/<name>.original.lora
    .safetensors``. Without: ``out`` becomes the pipeline folder ``pipeline`` with ``state`` as
    its transformer and its other components linked (:func:`link_frozen_components`), written
    under a temporary name and renamed into place; ``original`` adds
    ``out/<name>.original.safetensors``, the transformer in its original layout. Call on one
    process.

    Example::

        write_export(dit, gen.full_model_state(), "tiny_flux", "results/pipeline", name="ft")
    """
    out = Path(out)
    if has_adapters(transformer):
        out.mkdir(parents=True, exist_ok=True)
        tensors, metadata = adapter_file_state(transformer, state, lora_prefix)
        save_state(tensors, out / f"{name}.lora.safetensors", metadata)
        save_peft_folder(transformer, state, out / f"{name}.peft")
        write_original_lora(transformer, state, out / f"{name}{ORIGINAL_LORA_SUFFIX}")
        return out
    if original:
        _original_key_map(transformer)  # refused before anything is written
    partial = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir(parents=True)
    link_frozen_components(pipeline, partial)
    write_diffusers_folder(transformer, state, partial / TRAINED)
    if original:
        write_original_weights(transformer, state, partial / f"{name}{ORIGINAL_WEIGHTS_SUFFIX}")
    return replace_dir(partial, out)


def link_frozen_components(pipeline: str | Path, folder: Path) -> None:
    """Fill ``folder`` with the pipeline folder ``pipeline`` but its trained component: its
    top-level files (``model_index.json``) copied, every other component folder a symbolic
    link to the source's (its absolute real path), so multi-gigabyte encoders are never copied.
    ``DiffusionPipeline.from_pretrained`` follows the links; moving or deleting the source
    folder breaks them (``cp -rL`` makes a standalone copy).

    Example::

        link_frozen_components("tiny_wan", Path("results/pipeline"))
    """
    source = Path(pipeline).resolve()
    for part in source.iterdir():
        if part.is_dir() and part.name != TRAINED:
            # To the real folder: an export made from an export links past it, not through it.
            os.symlink(part.resolve(), folder / part.name, target_is_directory=True)
        elif part.is_file():
            shutil.copy2(part, folder / part.name)


def write_original_lora(
    transformer: nn.Module, state: Mapping[str, torch.Tensor], path: Path
) -> Path | None:
    """Write ``transformer``'s adapters in its original checkpoint's layout to ``path``
    (:func:`litegen.model_keys.original_format.lora_to_original`), alpha kept. None, with a
    logged reason and nothing written, when LiteGen knows no original layout for its class or
    an adapted module has no original counterpart: the diffusers-format files are the export
    then, and a finished run does not fail over the extra file.

    Example::

        write_original_lora(wan, wan.state_dict(), Path("out/run.original.lora.safetensors"))
    """
    key_map = key_map_for(transformer)
    if key_map is None:
        log.info(
            "No original-format LoRA for %s: LiteGen knows the original layout of %s only.",
            type(transformer).__name__,
            ", ".join(original_format_classes()),
        )
        return None
    rows = {clean_name(k): v for k, v in output_rows(transformer).items()}
    try:
        tensors = lora_to_original(adapter_alpha_state(transformer, state), key_map, rows=rows)
    except ValueError as err:
        log.warning("No original-format LoRA written (%s): %s", path.name, err)
        return None
    return save_state(tensors, path, {"format": "pt"})


def write_original_weights(
    transformer: nn.Module, state: Mapping[str, torch.Tensor], path: Path
) -> Path:
    """Write the full weights ``state`` of ``transformer`` as one safetensors file in its
    original checkpoint's layout (what ComfyUI's diffusion-model loader and diffusers'
    ``from_single_file`` read). ``ValueError`` for a class of unknown original layout.

    Example::

        write_original_weights(flux, flux.state_dict(), Path("out/ft.original.safetensors"))
    """
    tensors = weights_to_original(state, _original_key_map(transformer))
    return save_state(tensors, path, {"format": "pt"})


def _original_key_map(transformer: nn.Module) -> KeyMap:
    key_map = key_map_for(transformer)
    if key_map is None:
        raise ValueError(
            f"LiteGen knows no original checkpoint layout for {type(transformer).__name__} "
            f"(it knows {', '.join(original_format_classes())}); export without --original."
        )
    return key_map


def checkpoint_weights(
    model_dir: str | Path, module: nn.Module, *, ema: bool
) -> dict[str, torch.Tensor]:
    """The full weights of ``module`` from the DCP folder ``model_dir`` of a run checkpoint
    (``step_<N>/model_0``), the EMA's where it averaged them with ``ema``; what the checkpoint
    does not hold (a LoRA run's frozen base) is ``module``'s own. Reads in this process alone,
    whatever the number of ranks that saved it.

    Example::

        transformer.load_state_dict(checkpoint_weights("run/step_500/model_0", transformer,
                                                       ema=False))
    """
    import torch.distributed.checkpoint as dcp

    from litegen.checkpoint.dcp_reader import CheckedReader

    saved = read_metadata(Path(model_dir)).state_dict_metadata
    wanted = {f"model.{k}" for k in module.state_dict()}
    if ema:
        wanted |= {f"ema.{k}" for k in module.state_dict()}
        # The EMA averages what trains: each of those must be there, or the export would
        # quietly hold the model's own weights.
        trained = [k for k, p in module.named_parameters() if p.requires_grad]
        missing = [k for k in trained if f"ema.{k}" not in saved]
        if missing:
            raise ValueError(
                f"run checkpoint {model_dir} holds no EMA of {missing[:3]} ({len(missing)} of "
                f"{len(trained)} trained tensors); export the model's weights with --no-ema."
            )
    buffers = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in saved.items()
        if key in wanted and hasattr(meta, "size")
    }
    with warnings.catch_warnings():  # DCP warns that it loads in one process: it is meant to
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(buffers, storage_reader=CheckedReader(model_dir), no_dist=True)
    state = {key[len("model.") :]: t for key, t in buffers.items() if key.startswith("model.")}
    if ema:
        state.update({key[len("ema.") :]: t for key, t in buffers.items() if key[:4] == "ema."})
    own = module.state_dict()
    held = _held_by_run_checkpoints(module)
    check_model_state({k: v for k, v in own.items() if k in held or k in state}, state, model_dir)
    # A LoRA run checkpoint holds the adapters alone; the frozen base is the pipeline's.
    return {**own, **state}


def _held_by_run_checkpoints(module: nn.Module) -> set[str]:
    """The keys a run checkpoint of ``module`` holds, by the rule the strategies save with."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from litegen.parallel.base import dcp_options

    return set(get_model_state_dict(module, options=dcp_options(module)))


def checkpoint_has_ema(model_dir: str | Path) -> bool:
    """True when the DCP folder of a run checkpoint holds an EMA."""
    return any(key.startswith("ema.") for key in read_metadata(Path(model_dir)).state_dict_metadata)


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path | None = None,
    *,
    ema: bool | None = None,
    pipeline: str | Path | None = None,
    original: bool = False,
) -> Path:
    """Export a fine-tuning run checkpoint like the end of the run exports (:func:`write_export`).

    ``checkpoint``: a ``step_<N>`` folder, or the checkpoint_dir holding them (its latest).
    ``out``: by default ``<checkpoint_dir>/exports/step_<N>``; an existing one is refused.
    ``ema``: the EMA weights (default: the run's ``trainer.export_ema`` when it kept an EMA).
    ``pipeline``: the pipeline folder the run fine-tuned (default: its ``finetune.pipeline``, or
    ``model.pretrained`` for runs of earlier versions).
    ``original``: a full fine-tune also writes its transformer (each trained expert) in the
    original layout.
    Raises ``ValueError`` or ``FileNotFoundError`` naming the path and the fix.

    Example::

        export_checkpoint("results/finetune_video/step_500", "exported")
    """
    step_dir = resolve_checkpoint(checkpoint)
    config = read_config_text(step_dir)
    folder = (
        pipeline
        or (config.get("finetune") or {}).get("pipeline")
        or (config.get("model") or {}).get("pretrained")  # runs of earlier versions
    )
    if not folder:
        raise ValueError(
            f"run checkpoint {step_dir} fine-tunes no pipeline folder (its config has no "
            "finetune.pipeline); litegen export writes the runs of the fine-tuning recipes."
        )
    try:
        check_pipeline_folder(folder)
    except ValueError as err:
        raise ValueError(f"{err} Or pass the folder the run fine-tuned: --pipeline DIR.") from None
    out = Path(out) if out is not None else step_dir.parent / "exports" / step_dir.name
    if out.exists():
        raise ValueError(f"{out} already exists: pass another --out, or move it away first.")
    model_dir = step_dir / "model_0"
    has_ema = checkpoint_has_ema(model_dir)
    trainer = config.get("trainer") or {}
    use_ema = bool(trainer.get("export_ema", True)) and has_ema if ema is None else ema
    if use_ema and not has_ema:
        raise ValueError(
            f"run checkpoint {step_dir} holds no EMA (ema.enable was off); drop --ema."
        )
    lora = (config.get("optimization") or {}).get("lora")
    if lora:
        from litegen.config.sections import LoRAConfig

        lora = LoRAConfig.model_validate(lora)
    name = export_name(config.get("exp_name", "model"), use_ema)
    prefix = lora.prefix if lora else TRAINED
    index = json.loads((Path(folder) / "model_index.json").read_text(encoding="utf-8"))
    if pipeline_boundary(index) is not None:  # Wan 2.2 A14B: one export per trained expert
        from litegen.finetune.expert_models import experts_of, write_expert_exports

        named = (config.get("finetune") or {}).get("experts") or list(EXPERTS)
        trained = tuple(expert for expert in EXPERTS if expert in named)
        experts = experts_of(folder, trained, lora or None, pipeline_boundary(index) * 1000)
        state = checkpoint_weights(model_dir, experts, ema=use_ema)
        if original and not lora:
            _original_key_map(next(experts.children()))  # refused before anything is written
        return write_expert_exports(experts, state, folder, out, name=name, lora_prefix=prefix,
                                    write_one=write_export,
                                    write_original=write_original_weights if original else None)  # fmt: skip
    transformer = load_component(folder, TRAINED)
    if lora:
        from litegen.lora import apply_lora

        apply_lora(transformer, lora)
    state = checkpoint_weights(model_dir, transformer, ema=use_ema)
    return write_export(
        transformer, state, folder, out, name=name, lora_prefix=prefix, original=original
    )


def export_name(exp_name: str, ema: bool) -> str:
    """The file stem of a LoRA export: ``<exp_name>`` or ``<exp_name>.ema``; ValueError when
    ``exp_name`` cannot name a file (a separator would write outside the export folder)."""
    from litegen.checkpoint.layout import check_file_name

    return f"{check_file_name(exp_name, 'exp_name')}{'.ema' if ema else ''}"
