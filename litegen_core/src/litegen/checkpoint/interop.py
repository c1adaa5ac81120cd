"""Checkpoints from elsewhere: diffusers model folders, plain PyTorch state dicts, and the export
back to diffusers' layout.

Reading (``init_from``, ``resume_from``, ``ema.resume_from``, ``gen.load``):

- a file: LiteGen's own, or ``torch.save(model.state_dict())`` (``.pth``, ``.pt``, ``.bin``,
  ``.safetensors``);
- a folder written by diffusers' ``save_pretrained`` (``config.json`` beside
  ``diffusion_pytorch_model.safetensors``, or shards named by a ``*.safetensors.index.json``):
  only the weights are read, checked against the model's keys and shapes; the class and its
  config are the user's.

The optimizer state of ``resume_from`` is looked for beside the model: ``<stem>.optim_state.pth``
(LiteGen's name), then ``optimizer.pt``/``.pth``/``.bin`` in the same folder (for a diffusers
folder: inside it or in its parent, where accelerate's ``save_state`` puts ``optimizer.bin``).
A plain ``optimizer.state_dict()`` numbers the parameters in the order of the optimizer's
param groups; :func:`named_optimizer_state` names them through the order of the optimizer the
job built, so it must list the same parameters in the same order.

Writing: :func:`write_diffusers_folder` turns a full state dict into a folder that
``from_pretrained`` loads, through the model's own ``save_pretrained`` when it has one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from litegen.checkpoint.atomic import atomic_write, atomic_write_text
from litegen.checkpoint.files import load_state, optimizer_path_for
from litegen.checkpoint.formats import StateFormat

# diffusers' weight file names (diffusers.utils.constants), without importing diffusers.
WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
OPTIMIZER_NAMES = ("optimizer.pt", "optimizer.pth", "optimizer.bin")


def is_diffusers_folder(path: str | Path) -> bool:
    """A folder with ``config.json`` and diffusers' weight files (single or sharded)."""
    path = Path(path)
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and (any((path / name).is_file() for name in WEIGHTS) or bool(_index_files(path)))
    )


def _index_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors.index.json"))


def load_diffusers_weights(folder: str | Path, *, what: str = "checkpoint") -> dict[str, Any]:
    """The weights of a ``save_pretrained`` folder, on the CPU, keyed like the model.

    Example::

        state = load_diffusers_weights("DiT-XL-2-256/transformer")
    """
    folder = Path(folder)
    indexes = _index_files(folder)
    if indexes:
        if len(indexes) > 1:
            raise ValueError(
                f"{what}: {folder} holds several weight indexes ({[p.name for p in indexes]}); "
                "keep one variant of the weights in the folder."
            )
        weight_map = json.loads(indexes[0].read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{what}: {indexes[0]} has no weight_map; is the folder complete?")
        state: dict[str, Any] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(load_state(folder / shard, what=what))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise ValueError(
                f"{what}: the shards of {folder} lack {len(missing)} tensor(s) its index names "
                f"(first: {missing[:3]}); copy every shard file."
            )
        return state
    for name in WEIGHTS:
        if (folder / name).is_file():
            return load_state(folder / name, what=what)
    raise ValueError(
        f"{what}: {folder} has no {WEIGHTS[0]} (or a *.safetensors.index.json with shards); "
        "point to a folder written by save_pretrained, or to a weights file."
    )


class DiffusersFolder(StateFormat):
    """A model folder written by diffusers' ``save_pretrained``. It claims every folder, so a
    folder of another kind is refused with what a diffusers folder holds."""

    name = "diffusers"
    holds: ClassVar[tuple[str, ...]] = ("model",)

    def recognizes(self, path: Path) -> bool:
        return path.is_dir()

    def read(self, path: Path, what: str) -> dict[str, Any]:
        if is_diffusers_folder(path):
            return load_diffusers_weights(path, what=what)
        raise ValueError(
            f"{what}: {path} is a folder but not a diffusers model folder (config.json with "
            f"{WEIGHTS[0]} or sharded *.safetensors and their index); point to a weights file "
            "or a save_pretrained folder (a pipeline's transformer/ subfolder)."
        )


def load_model_source(path: str | Path, *, what: str = "checkpoint") -> dict[str, Any]:
    """Model weights from a file (LiteGen's or a plain state dict) or a diffusers folder.

    Example::

        state = load_model_source(config.init_from, what="init_from")
    """
    return load_state(path, what=what, holding="model")


def optimizer_file_for(model_path: str | Path) -> Path:
    """The optimizer state that goes with ``resume_from``'s model (the module docstring's order).

    Raises ``FileNotFoundError`` listing every place it looked.
    """
    model_path = Path(model_path)
    candidates = [optimizer_path_for(model_path)]
    folders = [model_path] if model_path.is_dir() else [model_path.parent]
    if is_diffusers_folder(model_path):
        folders.append(model_path.parent)
    candidates += [folder / name for folder in folders for name in OPTIMIZER_NAMES]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"resume_from: no optimizer state found for {model_path}; looked for "
        f"{', '.join(str(c) for c in candidates)}. Save it beside the model as "
        f"{candidates[0].name} (torch.save(optimizer.state_dict(), ...)), or load the weights "
        "alone with init_from."
    )


def is_plain_optimizer_state(state: Mapping[str, Any]) -> bool:
    """True for ``optimizer.state_dict()`` (parameters numbered), False for FQN-keyed states."""
    groups = state.get("param_groups") or []
    params = [p for group in groups for p in group.get("params", [])]
    return bool(params) and all(isinstance(p, int) for p in params)


def named_optimizer_state(
    state: Mapping[str, Any],
    param_names: Sequence[Sequence[str]],
    shapes: Mapping[str, Any],
    path: str | Path,
) -> dict[str, Any]:
    """A plain optimizer state dict keyed by parameter names (the full-state layout).

    ``param_names`` lists each param group's parameter names in the order of the optimizer the
    job built; ``shapes`` maps names to the model's tensors, to check per-element state.

    Example::

        named = named_optimizer_state(torch.load("optimizer.pt"), [["w", "b"]], shapes, "o.pt")
    """
    if "state" not in state or "param_groups" not in state:
        raise ValueError(
            f"optimizer file {path} is not an optimizer state dict (no 'state' and "
            "'param_groups'); save it with torch.save(optimizer.state_dict(), path)."
        )
    groups = state["param_groups"]
    saved = [len(g["params"]) for g in groups]
    ours = [len(names) for names in param_names]
    if saved != ours:
        raise ValueError(
            f"optimizer file {path} holds param groups of {saved} parameters, the optimizer "
            f"has {ours}; build the optimizer over the same parameters, in the same groups and "
            "order, as the run that saved it."
        )
    name_of = {
        index: name
        for group, names in zip(groups, param_names, strict=True)
        for index, name in zip(group["params"], names, strict=True)
    }
    named: dict[str, Any] = {}
    for index, values in state["state"].items():
        name = name_of.get(int(index))
        if name is None:
            raise ValueError(
                f"optimizer file {path} has state for parameter {index}, which no group lists."
            )
        expected = tuple(shapes[name].shape)
        for key, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != expected:
                raise ValueError(
                    f"optimizer file {path}: state '{key}' of parameter {index} has shape "
                    f"{tuple(value.shape)}, but that position of the optimizer is {name} of "
                    f"shape {expected}; the optimizer must list the parameters in the order of "
                    "the run that saved it."
                )
        named[name] = dict(values)
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
        for group, names in zip(groups, param_names, strict=True)
    ]
    return {"state": named, "param_groups": param_groups}


def write_diffusers_folder(
    module: nn.Module, state: Mapping[str, torch.Tensor], folder: Path
) -> Path:
    """Write ``state`` (the full weights of ``module``) so ``from_pretrained`` loads ``folder``.

    A diffusers model is rebuilt on the meta device from its config, given ``state`` and saved
    by its own ``save_pretrained`` (shards, config and all, as diffusers writes them). Any other
    model gets ``diffusion_pytorch_model.safetensors`` and, when it has a config (a dict, or an
    object with ``to_dict``), ``config.json``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if callable(getattr(module, "save_pretrained", None)) and hasattr(type(module), "from_config"):
        with torch.device("meta"):
            fresh = type(module).from_config(module.config)
        fresh.load_state_dict(dict(state), strict=True, assign=True)
        fresh.save_pretrained(folder, safe_serialization=True)
        return folder
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    atomic_write(folder / WEIGHTS[0], lambda tmp: save_file(tensors, str(tmp), {"format": "pt"}))
    config = getattr(module, "config", None)
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, Mapping):
        text = json.dumps(dict(config), indent=2, sort_keys=True, default=str)
        atomic_write_text(folder / "config.json", text + "\n")
    return folder
