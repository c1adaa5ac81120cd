"""Single-file checkpoints: names, atomic writes, the torch.save and safetensors formats, and
loads that say what is wrong.

Every file is written through :func:`litegen.checkpoint.atomic.atomic_write` (a temporary
name in the target folder, flushed and renamed into place), so a crash mid-write never leaves a
half-written checkpoint under the real name.
:func:`load_state` and :func:`save_state` go through the table of formats
(:mod:`litegen.checkpoint.formats`).
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

# The atomic writers are declared in the torch-free ``atomic``; older imports reach them here.
from litegen.checkpoint.atomic import atomic_write as atomic_write
from litegen.checkpoint.atomic import atomic_write_text as atomic_write_text
from litegen.checkpoint.atomic import replace_dir as replace_dir
from litegen.checkpoint.formats import (
    Holding,
    StateFormat,
    format_for_name,
    format_of,
    weight_suffixes,
)
from litegen.checkpoint.layout import KIND_SUFFIXES, Kind, check_file_name


def checkpoint_path(
    kind: Kind,
    *,
    default_folder: str,
    exp_name: str,
    output_folder: str | None = None,
    filename: str | None = None,
    step: int | None = None,
) -> Path:
    """Where ``save_model``/``save_optimizer``/``save_ema`` write.

    Example:
        >>> checkpoint_path("optimizer", default_folder="ckpt", exp_name="dit", step=10)
        PosixPath('ckpt/dit_step10.optim_state.pth')
    """
    folder = Path(output_folder or default_folder)
    if filename:
        return folder / check_file_name(filename, "filename")
    check_file_name(exp_name, "exp_name")
    prefix = exp_name if step is None else f"{exp_name}_step{step}"
    return folder / f"{prefix}{KIND_SUFFIXES[kind]}"


def optimizer_path_for(model_path: str | Path) -> Path:
    """The optimizer file saved beside a model file: ``model_10.pth`` -> ``model_10.optim_state.pth``
    (``model_10.lora.safetensors``, ``.pt`` and ``.bin`` too)."""
    path = Path(model_path)
    stem = path.name
    for suffix in (*weight_suffixes(), ".lora"):
        stem = stem.removesuffix(suffix)
    return path.with_name(stem + KIND_SUFFIXES["optimizer"])


class TorchFile(StateFormat):
    """``torch.save`` of a dict: LiteGen's ``.pth`` files and plain PyTorch state dicts. The
    catch-all of the single files: a name of no other format is read and written as this."""

    name = "torch"
    suffixes: ClassVar[tuple[str, ...]] = (".pth", ".pt", ".bin")

    def read(self, path: Path, what: str) -> dict[str, Any]:
        return _checked_load(
            path, what, lambda: torch.load(path, map_location="cpu", weights_only=True)
        )

    def write(
        self, state: Mapping[str, Any], path: Path, metadata: dict[str, str] | None = None
    ) -> Path:
        return atomic_write(path, lambda tmp: torch.save(dict(state), tmp))


class SafetensorsFile(StateFormat):
    """A ``.safetensors`` file; ``metadata`` goes into its header."""

    name = "safetensors"
    suffixes: ClassVar[tuple[str, ...]] = (".safetensors",)

    def read(self, path: Path, what: str) -> dict[str, Any]:
        return _checked_load(path, what, lambda: load_file(str(path), device="cpu"))

    def write(
        self, state: Mapping[str, Any], path: Path, metadata: dict[str, str] | None = None
    ) -> Path:
        # safetensors refuses shared or non-contiguous storage; checkpoints are small enough
        # on the CPU to copy once.
        tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def save_state(
    state: Mapping[str, Any], path: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """Write a state dict atomically; a ``.safetensors`` name selects the safetensors format,
    whose header gets ``metadata`` (other formats have no header and ignore it).

    Example:
        >>> save_state({"w": torch.ones(2)}, "ckpt/dit.safetensors", {"format": "pt"})
        PosixPath('ckpt/dit.safetensors')
    """
    return format_for_name(path).write(state, Path(path), metadata)


def load_state(
    path: str | Path, *, what: str = "checkpoint", holding: Holding = None
) -> dict[str, Any]:
    """Read a state dict onto the CPU, in whichever format that may hold ``holding`` it is
    (``"model"``, ``"optimizer"``; by default the single files :func:`save_state` or plain
    ``torch.save`` write).

    ``what`` names the state in errors (``init_from``, ``optimizer``).

    Example:
        >>> _ = save_state({"pos_embed": torch.zeros(2)}, "results/dit/dit.pth")
        >>> load_state("results/dit/dit.pth", what="init_from")
        {'pos_embed': tensor([0., 0.])}
    """
    return format_of(path, holding).read(Path(path), what)


def _checked_load(path: Path, what: str, load: Callable[[], Any]) -> dict[str, Any]:
    """``load()`` of a single file, its failures turned into errors that name the file."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{what} file not found: {path}. Check the path (relative paths are resolved "
            f"from {Path.cwd()})."
        )
    try:
        state = load()
    except (
        SafetensorError,
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,
        zipfile.BadZipFile,
    ) as err:
        raise ValueError(
            f"{what} file {path} is truncated or not a checkpoint ({type(err).__name__}: {err}). "
            "Point to a complete file written by save_model/save_optimizer/save_ema."
        ) from err
    if not isinstance(state, dict):
        raise ValueError(f"{what} file {path} holds a {type(state).__name__}, not a state dict.")
    # A whole pickled training checkpoint often nests the weights; accept the common layouts.
    for key in ("model", "state_dict", "module"):
        if key in state and isinstance(state[key], dict) and len(state) <= 4:
            state = state[key]
            break
    return state


def check_model_state(
    expected: Mapping[str, torch.Tensor], state: Mapping[str, Any], path: str | Path
) -> None:
    """Raise one ValueError naming the file and every missing, unexpected or reshaped key."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in state
        and isinstance(state[k], torch.Tensor)
        and tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_preview(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_preview(unexpected)}")
    if reshaped:
        problems.append(f"shape mismatches: {_preview(reshaped)}")
    if problems:
        raise ValueError(
            f"checkpoint {path} does not match the model: "
            + "; ".join(problems)
            + ". Was it saved from the same model configuration?"
        )


def _preview(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" ... (+{len(items) - limit} more)" if len(items) > limit else "")


def check_adapter_shapes(
    expected: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], path: str | Path
) -> None:
    """``adapters`` (an adapter file keyed like the model) at the shapes of the model's own
    adapters; a ValueError naming the file and each differing shape otherwise (a file saved
    with another ``optimization.lora.rank``)."""
    try:
        check_model_state({k: v for k, v in expected.items() if k in adapters}, adapters, path)
    except ValueError as err:
        raise ValueError(
            f"{err} An adapter file of another optimization.lora.rank (or target_modules) "
            "cannot be loaded; set the rank it was saved with, or start the adapters afresh."
        ) from None
