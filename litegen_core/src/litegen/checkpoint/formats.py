"""The ways a state dict lies on disk, behind one interface, and the one place that tells them apart.

A format is a :class:`StateFormat` subclass in the module that knows it, and one row in
:data:`FORMATS`. Reading sniffs the path through :func:`format_of`, which asks each format in
the table's order whether the path is one of its own; writing picks the single-file format by
the file name (:func:`format_for_name`). This module imports no format at load (each row is a
``"module:Class"`` path), so it stays torch-free.

The readers and writers behind the table are reached through
:func:`litegen.checkpoint.files.load_state` and :func:`~litegen.checkpoint.files.save_state`.

Example:
    >>> format_for_name("dit.lora.safetensors").name
    'safetensors'
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Literal

# format name -> "module:Class", in the order format_of asks them. The last row is the
# catch-all: a path no other format recognises is read as one of its files (and a foreign file
# is reported by its reader).
FORMATS: dict[str, str] = {
    "diffusers": "litegen.checkpoint.interop:DiffusersFolder",
    "zero_sharded": "litegen.checkpoint.zero_state:ZeroShards",
    "safetensors": "litegen.checkpoint.files:SafetensorsFile",
    "torch": "litegen.checkpoint.files:TorchFile",
}

# What a caller reads: model weights or an optimizer state (formats that hold it), or any state
# in a single file (None: formats with suffixes).
Holding = Literal["model", "optimizer"] | None


class StateFormat:
    """One way a state dict lies on disk: how it is recognised, read and written.

    ``suffixes``: a file written in this format ends in one of them; a format with suffixes is a
    single file, which :func:`format_for_name` picks by name. ``holds``: the states it may
    hold (a ZeRO manifest holds no model weights, a diffusers folder no optimizer state).
    ``manifest_tag``: the ``"format"`` value of the JSON manifest the format writes beside its
    data (:func:`litegen.checkpoint.manifest.read_manifest` reads it), None when it writes none.

    Example:
        >>> class NumpyFile(StateFormat):
        ...     name, suffixes = "numpy", (".npz",)
        ...     def read(self, path, what):
        ...         return {k: torch.from_numpy(v) for k, v in np.load(path).items()}
    """

    name: ClassVar[str]
    suffixes: ClassVar[tuple[str, ...]] = ()
    holds: ClassVar[tuple[str, ...]] = ("model", "optimizer")
    manifest_tag: ClassVar[str | None] = None

    def recognizes(self, path: Path) -> bool:
        """Whether ``path`` (which may not exist) is in this format; by default, by its name."""
        return bool(self.suffixes) and path.name.endswith(self.suffixes)

    def read(self, path: Path, what: str) -> dict[str, Any]:
        """The state at ``path`` on the CPU; ``what`` names it in errors (``init_from``)."""
        raise NotImplementedError

    def write(
        self, state: Mapping[str, Any], path: Path, metadata: dict[str, str] | None = None
    ) -> Path:
        """Write ``state`` to ``path`` atomically (``metadata``: header text, where kept)."""
        raise NotImplementedError(f"the {self.name} format is written by its own function")


@cache
def state_format(name: str) -> StateFormat:
    """The format registered under ``name`` (its module is imported now).

    Example:
        >>> state_format("torch").suffixes
        ('.pth', '.pt', '.bin')
    """
    if name not in FORMATS:
        raise ValueError(f"unknown checkpoint format {name!r}; use one of {', '.join(FORMATS)}.")
    module_name, class_name = FORMATS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()


def formats_holding(holding: Holding) -> list[StateFormat]:
    """The formats, in table order, that may hold ``holding`` (None: the single files).

    Example:
        >>> [f.name for f in formats_holding("optimizer")]
        ['zero_sharded', 'safetensors', 'torch']
    """
    found = [state_format(name) for name in FORMATS]
    if holding is None:
        return [f for f in found if f.suffixes]
    return [f for f in found if holding in f.holds]


def format_of(path: str | Path, holding: Holding = None) -> StateFormat:
    """The format of ``path`` among those holding ``holding``: the first that recognises it,
    else the last (the catch-all, whose reader reports a foreign file). The one place that
    tells formats apart.

    Example::

        format_of(Path("ckpt/dit.optim_state.pth"), "optimizer").name
    """
    path = Path(path)
    candidates = formats_holding(holding)
    return next((f for f in candidates if f.recognizes(path)), candidates[-1])


def format_for_name(path: str | Path) -> StateFormat:
    """The single-file format a new file named ``path`` is written in (torch.save by default).

    Example:
        >>> format_for_name("dit_step10.pth").name
        'torch'
    """
    return format_of(path)


@cache
def weight_suffixes() -> tuple[str, ...]:
    """Every suffix a single state file may end in.

    Example:
        >>> weight_suffixes()
        ('.safetensors', '.pth', '.pt', '.bin')
    """
    return tuple(suffix for f in formats_holding(None) for suffix in f.suffixes)
