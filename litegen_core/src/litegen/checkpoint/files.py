"""Single-file checkpoints: names, atomic writes, and loads that say what is wrong.

Every file is written to a temporary name in the target folder, flushed to disk and renamed
into place, so a crash mid-write never leaves a half-written checkpoint under the real name.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import uuid
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

Kind = Literal["model", "optimizer", "ema", "lora", "ema_lora"]
_SUFFIX: dict[str, str] = {
    "model": ".pth",
    "optimizer": ".optim_state.pth",
    "ema": ".ema.pth",
    # The adapters of a LoRA run (litegen.lora), in place of the model and EMA files.
    "lora": ".lora.safetensors",
    "ema_lora": ".ema.lora.safetensors",
}


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
        return folder / filename
    prefix = exp_name if step is None else f"{exp_name}_step{step}"
    return folder / f"{prefix}{_SUFFIX[kind]}"


def optimizer_path_for(model_path: str | Path) -> Path:
    """The optimizer file saved beside a model file: ``model_10.pth`` -> ``model_10.optim_state.pth``
    (``model_10.lora.safetensors``, ``.pt`` and ``.bin`` too)."""
    path = Path(model_path)
    stem = path.name
    for suffix in (".safetensors", ".pth", ".pt", ".bin", ".lora"):
        stem = stem.removesuffix(suffix)
    return path.with_name(stem + _SUFFIX["optimizer"])


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)``, fsync, then rename onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_write`."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def replace_dir(tmp: str | Path, final: str | Path) -> Path:
    """Rename a finished folder onto ``final``; an older ``final`` steps aside, then goes.

    A crash between the two renames leaves the old folder under ``.<name>.old-*``, never a
    half-written one under ``final``.
    """
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def save_state(
    state: Mapping[str, Any], path: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """Write a state dict atomically; a ``.safetensors`` name selects the safetensors format,
    whose header gets ``metadata`` (other formats have no header and ignore it)."""
    if str(path).endswith(".safetensors"):
        # safetensors refuses shared or non-contiguous storage; checkpoints are small enough
        # on the CPU to copy once.
        tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return atomic_write(path, lambda tmp: torch.save(dict(state), tmp))


def load_state(path: str | Path, *, what: str = "checkpoint") -> dict[str, Any]:
    """Read a state dict written by :func:`save_state` (or plain ``torch.save``) onto the CPU."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{what} file not found: {path}. Check the path (relative paths are resolved "
            f"from {Path.cwd()})."
        )
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path), device="cpu")
        state = torch.load(path, map_location="cpu", weights_only=True)
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
