"""LoRA fine-tuning through peft: adapters on the first trainable model, saved for diffusers.

    optimization:
      lora: {rank: 16, alpha: 16, target_modules: [to_q, to_k, to_v, to_out.0]}

``prepare`` loads ``init_from``, then injects the adapters (:func:`apply_lora`) before
activation checkpointing, compile and the strategy's wrap, which all act on the adapted
model: peft matches ``target_modules`` against the user's module names, checkpointed and
compiled blocks then include the adapter layers, and DDP or FSDP register the adapters with
the model's other parameters. A model the user already adapted with peft is taken as it is.

The user's optimizer, built on ``model.parameters()`` before ``prepare``, is rebound in place
(:func:`train_adapters`): each adapter joins the param group of the weight it adapts, and
frozen parameters leave the groups; hyperparameters and LR schedulers stay valid.

Adapter files hold peft's keys (those of ``get_peft_model_state_dict``: the adapter name
removed) under ``<prefix>.`` and diffusers' ``lora_adapter_metadata`` header (rank, targets).
Each ``lora_B`` holds its layer's scale (``alpha / rank``) multiplied in, and the header says
alpha = rank: loaders that read the header (``pipe.load_lora_weights``) and those that do not
(``model.load_lora_adapter(path)``, which then takes alpha = rank) give the trained model's
outputs. :func:`save_peft_folder` writes peft's own layout instead (the true alpha, the
weights as trained), for ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from litegen.model_parts.paths import clean_name

log = logging.getLogger("litegen")

PEFT_MISSING = (
    "optimization.lora needs the 'peft' package: install LiteGen's 'lora' extra "
    "(pip install 'litegen-core[lora]', or uv sync --all-packages --extra lora), or "
    "pip install peft."
)
# diffusers' key for the LoRA config in a safetensors header (diffusers.loaders.lora_base).
METADATA_KEY = "lora_adapter_metadata"
# Prefix of parameter names inside a ``peft.PeftModel`` (``get_peft_model``'s wrapper).
_PEFT_MODEL_PREFIX = "base_model.model."
# The files of a peft adapter folder (peft.utils.constants).
PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError(PEFT_MISSING) from None
    return peft


def adapter_layers(model: nn.Module) -> list[nn.Module]:
    """peft's adapter layers inside ``model`` (none when peft was never imported).

    Example:
        >>> from litegen.config.sections import LoRAConfig
        >>> dit = nn.ModuleDict({"to_q": nn.Linear(8, 8), "to_v": nn.Linear(8, 8), "proj": nn.Linear(8, 8)})
        >>> len(adapter_layers(apply_lora(dit, LoRAConfig(rank=4, target_modules=["to_q", "to_v"]))))
        2
    """
    if "peft" not in sys.modules:  # a model cannot carry adapters without peft loaded
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_adapters(model: nn.Module) -> bool:
    """True when ``model`` carries peft adapters (applied by LiteGen or by the user)."""
    return bool(adapter_layers(model))


def apply_lora(model: nn.Module, cfg: Any) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place; only the adapters stay trainable.

    ``cfg`` is an ``optimization.lora`` section (:class:`litegen.config.LoRAConfig`). diffusers
    models get them through their own ``add_adapter`` (so ``set_adapter``, ``fuse_lora`` and
    ``load_lora_adapter`` keep working), other modules through peft's
    ``inject_adapter_in_model``. A model that already carries adapters is returned unchanged.

    Example:
        >>> from litegen.config.sections import LoRAConfig
        >>> dit = nn.ModuleDict({"to_q": nn.Linear(8, 8), "to_v": nn.Linear(8, 8), "proj": nn.Linear(8, 8)})
        >>> dit = apply_lora(dit, LoRAConfig(rank=8, target_modules=["to_q", "to_v"]))
        >>> [name for name, p in dit.named_parameters() if p.requires_grad]
        ['to_q.lora_A.default.weight', 'to_q.lora_B.default.weight',
         'to_v.lora_A.default.weight', 'to_v.lora_B.default.weight']
    """
    if has_adapters(model):
        log.info(
            "%s already carries peft adapters; optimization.lora adds none.", type(model).__name__
        )
        return model
    peft = _peft()
    config = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha if cfg.alpha is not None else cfg.rank,
        target_modules=cfg.target_modules,
        lora_dropout=cfg.dropout,
    )
    try:
        if _is_diffusers_model(model):
            model.add_adapter(config)
        else:
            peft.inject_adapter_in_model(config, model)
    except ValueError as err:
        if "not found in the base model" not in str(err) and "No modules were" not in str(err):
            raise
        raise ValueError(
            f"optimization.lora.target_modules {cfg.target_modules!r} matched no module of "
            f"{type(model).__name__} ({err}); name Linear or Conv layers of the model, e.g. "
            "['to_q', 'to_k', 'to_v', 'to_out.0'] for diffusers attention."
        ) from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA rank %d on %d modules of %s: %s of %s parameters trainable",
        cfg.rank,
        len(adapter_layers(model)),
        type(model).__name__,
        f"{trainable:,}",
        f"{total:,}",
    )
    return model


def _is_diffusers_model(model: nn.Module) -> bool:
    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and isinstance(model, diffusers.loaders.peft.PeftAdapterMixin)


def train_adapters(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Rebind ``optimizer``'s param groups in place to ``model``'s adapters.

    Each adapter parameter the optimizer lacks joins the group that holds the weight it adapts
    (the first group when the optimizer holds none of that layer); parameters that are frozen
    leave their groups. Group dicts, their hyperparameters and their number are kept, so an LR
    scheduler built on the optimizer stays valid. An optimizer built on the trainable
    parameters only is left as it is.

    Example:
        >>> from litegen.config.sections import LoRAConfig
        >>> model = nn.ModuleDict({"to_q": nn.Linear(8, 8), "to_v": nn.Linear(8, 8), "proj": nn.Linear(8, 8)})
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        >>> model = apply_lora(model, LoRAConfig(rank=4, target_modules=["to_q", "to_v"]))
        >>> train_adapters(optimizer, model)
        >>> sum(p.numel() for group in optimizer.param_groups for p in group["params"])  # 4 x (8 x 4)
        128
    """
    groups = optimizer.param_groups
    group_of = {id(p): i for i, group in enumerate(groups) for p in group["params"]}
    added = 0
    for layer in adapter_layers(model):
        base = list(layer.get_base_layer().parameters())
        base_ids = {id(p) for p in base}
        index = next((group_of[id(p)] for p in base if id(p) in group_of), 0)
        for param in layer.parameters():
            if param.requires_grad and id(param) not in base_ids and id(param) not in group_of:
                groups[index]["params"].append(param)
                group_of[id(param)] = index
                added += 1
    dropped = 0
    for group in groups:
        frozen = [p for p in group["params"] if not p.requires_grad]
        for param in frozen:
            optimizer.state.pop(param, None)
        group["params"] = [p for p in group["params"] if p.requires_grad]
        dropped += len(frozen)
    if added or dropped:
        log.info(
            "LoRA: %s now steps the %d adapter parameters (%d frozen parameters left its param "
            "groups, whose settings are kept)",
            type(optimizer).__name__,
            sum(len(g["params"]) for g in groups),
            dropped,
        )


# -- adapter files ---------------------------------------------------------------------------
def _adapter_name(model: nn.Module) -> str:
    active = {name for layer in adapter_layers(model) for name in layer.active_adapters}
    if len(active) != 1:
        raise ValueError(
            f"{type(model).__name__} has {len(active)} active peft adapters "
            f"({sorted(active)}); activate one (set_adapter) to save or load it."
        )
    return active.pop()


def export_key(name: str, adapter: str) -> str:
    """A parameter name as peft's ``get_peft_model_state_dict`` spells it (no adapter name).

    Example:
        >>> export_key("blocks.0.attn.to_q.lora_A.default.weight", "default")
        'blocks.0.attn.to_q.lora_A.weight'
    """
    name = clean_name(name).removeprefix(_PEFT_MODEL_PREFIX)
    return re.sub(rf"(\.lora_\w+)\.{re.escape(adapter)}(?=\.|$)", r"\1", name)


def _exported_names(model: nn.Module) -> dict[str, str]:
    """File key (without prefix) -> the model's state-dict name, for every adapter parameter."""
    adapter = _adapter_name(model)
    return {
        export_key(name, adapter): clean_name(name)
        for name, _ in model.named_parameters()
        if ".lora_" in name
    }


def _scales(model: nn.Module, adapter: str) -> dict[str, float]:
    """Export path of each adapted layer (``blocks.0.attn.to_q``) -> the scale peft applies
    to its adapter's output (``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {
        export_key(name, adapter): float(module.scaling[adapter])
        for name, module in model.named_modules()
        if isinstance(module, BaseTunerLayer) and adapter in getattr(module, "scaling", {})
    }


def _scale_of(key: str, scales: Mapping[str, float]) -> float:
    """The factor a file key's tensor carries: its layer's scale for ``lora_B``, else 1."""
    layer, sep, _ = key.partition(".lora_B.")
    return scales.get(layer, 1.0) if sep else 1.0


def adapter_file_state(
    model: nn.Module, state: Mapping[str, torch.Tensor], prefix: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The adapter tensors of ``state`` keyed for diffusers, and the file's metadata.

    ``model`` is the user's (unwrapped) module that names the adapters; ``state`` holds at
    least their full values, keyed by the model's state-dict names. Each ``lora_B`` is
    multiplied by its layer's scale and the metadata says alpha = rank (scale 1), so the file
    means the same to loaders that read the metadata and to those that do not.

    Example:
        >>> from litegen.config.sections import LoRAConfig
        >>> dit = nn.ModuleDict({"to_q": nn.Linear(8, 8), "to_v": nn.Linear(8, 8), "proj": nn.Linear(8, 8)})
        >>> dit = apply_lora(dit, LoRAConfig(rank=4, target_modules=["to_q", "to_v"]))
        >>> tensors, metadata = adapter_file_state(dit, dit.state_dict(), prefix="transformer")
        >>> next(iter(tensors))
        'transformer.to_q.lora_A.weight'
    """
    adapter = _adapter_name(model)
    scales = _scales(model, adapter)
    tensors = {}
    for key, name in _exported_names(model).items():
        scale = _scale_of(key, scales)
        tensors[f"{prefix}.{key}"] = state[name] * scale if scale != 1.0 else state[name]
    metadata = {"format": "pt"}
    config = getattr(model, "peft_config", {}).get(adapter)
    if config is not None:
        fields = config.to_dict()
        # The scales are in the weights: alpha = rank everywhere.
        fields.update(
            lora_alpha=fields["r"], alpha_pattern=dict(fields["rank_pattern"]), use_rslora=False
        )
        packed = {f"{prefix}.{k}": _json_safe(v) for k, v in fields.items()}
        metadata[METADATA_KEY] = json.dumps(packed, indent=2, sort_keys=True)
    return tensors, metadata


def adapter_alpha_state(
    model: nn.Module, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The adapter tensors of ``state`` as trained, keyed ``<module>.lora_A.weight`` and
    ``<module>.lora_B.weight``, with each module's ``<module>.alpha`` (its scale times its
    rank): the kohya-style layout the original-format converters read.

    Example:
        >>> from litegen.config.sections import LoRAConfig
        >>> dit = nn.ModuleDict({"to_q": nn.Linear(8, 8), "proj": nn.Linear(8, 8)})
        >>> dit = apply_lora(dit, LoRAConfig(rank=4, alpha=8, target_modules=["to_q"]))
        >>> adapter_alpha_state(dit, dit.state_dict())["to_q.alpha"]
        tensor(8.)
    """
    adapter = _adapter_name(model)
    scales = _scales(model, adapter)
    tensors = {key: state[name] for key, name in _exported_names(model).items()}
    for key, value in list(tensors.items()):
        layer, sep, _ = key.partition(".lora_A.")
        if sep:
            alpha = scales.get(layer, 1.0) * value.shape[0]
            tensors[f"{layer}.alpha"] = torch.tensor(alpha, dtype=torch.float32)
    return tensors


def save_peft_folder(model: nn.Module, state: Mapping[str, torch.Tensor], folder: Path) -> Path:
    """Write ``model``'s adapters as a peft folder: ``adapter_config.json`` (the true rank and
    alpha) and ``adapter_model.safetensors`` (the weights as trained), which
    ``peft.PeftModel.from_pretrained(base_model, folder)`` loads. Call on one rank.

    Example:
        >>> from litegen.config.sections import LoRAConfig
        >>> dit = nn.ModuleDict({"to_q": nn.Linear(8, 8), "to_v": nn.Linear(8, 8), "proj": nn.Linear(8, 8)})
        >>> dit = apply_lora(dit, LoRAConfig(rank=4, target_modules=["to_q", "to_v"]))
        >>> sorted(p.name for p in save_peft_folder(dit, dit.state_dict(), Path("run.peft")).iterdir())
        ['adapter_config.json', 'adapter_model.safetensors']
    """
    from litegen.checkpoint.atomic import atomic_write_text, replace_dir
    from litegen.checkpoint.files import save_state

    adapter = _adapter_name(model)
    config = getattr(model, "peft_config", {}).get(adapter)
    if config is None:
        raise ValueError(
            f"{type(model).__name__}'s adapters carry no peft config (peft_config); a peft "
            "folder needs one: apply them with optimization.lora, add_adapter or get_peft_model."
        )
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: the folder appears with both files or not at
    # all (an older one stays until the new one is complete).
    partial = folder.with_name(f".{folder.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir()
    try:
        tensors = {
            f"{_PEFT_MODEL_PREFIX}{key}": state[name]
            for key, name in _exported_names(model).items()
        }
        save_state(tensors, partial / PEFT_WEIGHTS_NAME, {"format": "pt"})
        fields = {k: _json_safe(v) for k, v in config.to_dict().items()}
        text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
        atomic_write_text(partial / PEFT_CONFIG_NAME, text)
        return replace_dir(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _json_safe(value: Any) -> Any:
    return sorted(value) if isinstance(value, set | frozenset) else value


def is_adapter_file(state: Mapping[str, Any]) -> bool:
    """True when a loaded file holds LoRA adapters only (keys with ``lora_``)."""
    return bool(state) and all(".lora_" in key for key in state)


def model_keyed(
    model: nn.Module, state: Mapping[str, torch.Tensor], prefix: str, path: str | Path
) -> dict[str, torch.Tensor]:
    """An adapter file's tensors keyed like ``model``'s state dict; ValueError on a mismatch.

    Example::

        model_keyed(dit, load_state("dit.lora.safetensors"), "transformer", path)
    """
    names = _exported_names(model)
    scales = _scales(model, _adapter_name(model))
    given = {key.removeprefix(f"{prefix}."): value for key, value in state.items()}
    missing = sorted(set(names) - set(given))
    unexpected = sorted(set(given) - set(names))
    if missing or unexpected:
        raise ValueError(
            f"LoRA file {path} does not match the model's adapters (key prefix {prefix!r}): "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}. Was it saved with the same "
            "optimization.lora (rank, target_modules, prefix)?"
        )
    # The file's lora_B carry their layer's scale (adapter_file_state); the model applies it.
    return {names[key]: value / _scale_of(key, scales) for key, value in given.items()}
